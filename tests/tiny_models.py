"""Tiny configs shared by several test modules."""

from metrale_jax.config import ModelConfig

# every block kind (M * E -), grouped routing, a latent MoE and a scaled router: the model and runtime tests' model
ALL_KINDS = ModelConfig.from_hf(dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-", mamba_num_heads=4, mamba_head_dim=8,
    ssm_state_size=8, n_groups=2, chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2, moe_latent_size=16, routed_scaling_factor=2.5))
