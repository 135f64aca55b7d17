"""Independent float64 numpy references: token-by-token loops written from the model's equations."""

import numpy as np


def softplus(v):
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def ssm_recurrence(x, dt, A, B, C, D=None, dt_bias=None, dt_limit=(0.0, np.inf), h0=None):
    """One sequence, float64.  x [T, H, P], dt [T, H] raw, A [H], B/C [T, G, N], h0 [H, P, N].
    Returns (y [T, H, P], final state [H, P, N])."""
    x, dt, A, B, C = (np.asarray(a, np.float64) for a in (x, dt, A, B, C))
    T, H, P = x.shape
    G, N = B.shape[1:]
    h = np.zeros((H, P, N)) if h0 is None else np.array(h0, np.float64)
    Bh = np.repeat(B, H // G, axis=1)                     # [T, H, N]
    Ch = np.repeat(C, H // G, axis=1)
    d = softplus(dt + (0.0 if dt_bias is None else np.asarray(dt_bias, np.float64)))
    d = np.clip(d, dt_limit[0], dt_limit[1])              # [T, H]
    y = np.zeros((T, H, P))
    for t in range(T):
        h = np.exp(d[t] * A)[:, None, None] * h + d[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None, :]
        y[t] = np.einsum("hpn,hn->hp", h, Ch[t])
        if D is not None:
            y[t] += np.asarray(D, np.float64)[:, None] * x[t]
    return y, h


def causal_conv(x, w, b=None, state=None, silu=True):
    """One sequence, float64.  x [T, C], w [C, K], state [C, K-1] (oldest first)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    T, Cn = x.shape
    K = w.shape[1]
    hist = np.zeros((Cn, K - 1)) if state is None else np.asarray(state, np.float64)
    ext = np.concatenate([hist.T, x], axis=0)  # [K-1+T, C]
    y = np.stack([(ext[t:t + K] * w.T).sum(0) for t in range(T)]) if T else np.zeros((0, Cn))
    if b is not None:
        y = y + np.asarray(b, np.float64)
    if silu:
        y = y / (1.0 + np.exp(-y))
    return y, ext[ext.shape[0] - (K - 1):].T


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
