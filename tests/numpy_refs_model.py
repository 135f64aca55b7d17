"""Independent float64 numpy references for the attention, MLP and MoE blocks and the whole model,
written from the equations (HF Nemotron-H semantics), over HF-named tensors."""

import numpy as np

from tests.numpy_refs import causal_conv, ssm_recurrence


def f64(a):
    return np.asarray(a, np.float64)


def rmsnorm(x, w, eps):
    x = f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(w)


def lin(x, w, b=None):
    y = f64(x) @ f64(w).T
    return y if b is None else y + f64(b)


def relu2(x):
    return np.maximum(x, 0.0) ** 2


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def attention(x, wq, wk, wv, wo, *, heads, kv_heads, head_dim, bq=None, bk=None, bv=None, bo=None,
              k_prefix=None, v_prefix=None):
    """Causal GQA over one sequence of already-normalised rows x [T, D] (no residual).  k/v_prefix
    [P, KVH, hd]: cached keys/values before the first row.  Returns [T, D]."""
    T = x.shape[0]
    q = lin(x, wq, bq).reshape(T, heads, head_dim)
    k = lin(x, wk, bk).reshape(T, kv_heads, head_dim)
    v = lin(x, wv, bv).reshape(T, kv_heads, head_dim)
    if k_prefix is not None:
        k = np.concatenate([f64(k_prefix), k])
        v = np.concatenate([f64(v_prefix), v])
    P = k.shape[0] - T
    rep = heads // kv_heads
    out = np.zeros((T, heads, head_dim))
    for h in range(heads):
        kh, vh = k[:, h // rep], v[:, h // rep]
        for t in range(T):
            s = kh[: P + t + 1] @ q[t, h] * head_dim ** -0.5
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vh[: P + t + 1]
    return lin(out.reshape(T, heads * head_dim), wo, bo)


def mlp(x, up, down, up_b=None, down_b=None):
    return lin(relu2(lin(x, up, up_b)), down, down_b)


def route(logits, bias, *, n_group, topk_group, top_k, norm_topk_prob, scale):
    """Per token, by explicit sorting: (expert ids as sorted lists, weights in the same order)."""
    experts, weights = [], []
    E = logits.shape[1]
    per = E // n_group
    for row in f64(logits):
        s = sigmoid(row)
        c = s + f64(bias)
        gscore = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:top_k]
        w = np.array([s[e] for e in chosen])
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        order = np.argsort(chosen)
        experts.append([chosen[i] for i in order])
        weights.append(w[order] * scale)
    return experts, weights


def moe(x, t, p, cfg):
    """MoE on normalised rows x [T, D] from HF-named tensors t with mixer prefix p."""
    logits = f64(x) @ f64(t[p + "gate.weight"]).T
    experts, weights = route(logits, t[p + "gate.e_score_correction_bias"], n_group=cfg.n_group,
                             topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                             norm_topk_prob=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    latent = cfg.moe_latent_size is not None
    xl = lin(x, t[p + "fc1_latent_proj.weight"], t.get(p + "fc1_latent_proj.bias")) if latent else f64(x)
    y = np.zeros_like(xl)
    for i in range(x.shape[0]):
        for e, w in zip(experts[i], weights[i]):
            up, down = t[p + f"experts.{e}.up_proj.weight"], t[p + f"experts.{e}.down_proj.weight"]
            y[i] += w * mlp(xl[i:i + 1], up, down)[0]
    if latent:
        y = lin(y, t[p + "fc2_latent_proj.weight"], t.get(p + "fc2_latent_proj.bias"))
    if cfg.n_shared_experts:
        q = p + "shared_experts."
        y = y + mlp(x, t[q + "up_proj.weight"], t[q + "down_proj.weight"], t.get(q + "up_proj.bias"),
                    t.get(q + "down_proj.bias"))
    return y


def mamba_mixer(x, t, p, cfg):
    """Mamba-2 mixer on normalised rows x [T, D] of one sequence from a zero state."""
    I, C, H, G, N = cfg.d_inner, cfg.conv_dim, cfg.mamba_num_heads, cfg.n_groups, cfg.ssm_state_size
    zxbcdt = lin(x, t[p + "in_proj.weight"])
    z, xbc, dt = zxbcdt[:, :I], zxbcdt[:, I:I + C], zxbcdt[:, I + C:]
    xbc, _ = causal_conv(xbc, f64(t[p + "conv1d.weight"]).reshape(C, -1), t.get(p + "conv1d.bias"))
    T = x.shape[0]
    xs = xbc[:, :I].reshape(T, H, -1)
    B = xbc[:, I:I + G * N].reshape(T, G, N)
    Cm = xbc[:, I + G * N:].reshape(T, G, N)
    y, _ = ssm_recurrence(xs, dt, -np.exp(f64(t[p + "A_log"])), B, Cm, D=t[p + "D"], dt_bias=t[p + "dt_bias"],
                          dt_limit=cfg.time_step_limit)
    g = y.reshape(T, I) * z * sigmoid(z)
    gs = g.reshape(T, G, I // G)
    g = (gs / np.sqrt((gs * gs).mean(-1, keepdims=True) + cfg.layer_norm_epsilon)).reshape(T, I)
    return lin(g * f64(t[p + "norm.weight"]), t[p + "out_proj.weight"])


def model_forward(t, cfg, ids):
    """Logits [T, V] of one sequence of token ids, float64, from HF-named tensors t."""
    h = f64(t["backbone.embeddings.weight"])[np.asarray(ids)]
    eps = cfg.layer_norm_epsilon
    for i, kind in enumerate(cfg.hybrid_override_pattern):
        p = f"backbone.layers.{i}.mixer."
        x = rmsnorm(h, t[f"backbone.layers.{i}.norm.weight"], eps)
        if kind == "M":
            h = h + mamba_mixer(x, t, p, cfg)
        elif kind == "*":
            h = h + attention(x, t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"],
                              t[p + "o_proj.weight"], heads=cfg.num_attention_heads,
                              kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                              bq=t.get(p + "q_proj.bias"), bk=t.get(p + "k_proj.bias"),
                              bv=t.get(p + "v_proj.bias"), bo=t.get(p + "o_proj.bias"))
        elif kind == "-":
            h = h + mlp(x, t[p + "up_proj.weight"], t[p + "down_proj.weight"], t.get(p + "up_proj.bias"),
                        t.get(p + "down_proj.bias"))
        else:
            h = h + moe(x, t, p, cfg)
    h = rmsnorm(h, t["backbone.norm_f.weight"], eps)
    head = t["backbone.embeddings.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    return h @ f64(head).T


def log_softmax(x, axis=-1):
    x = f64(x)
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))
