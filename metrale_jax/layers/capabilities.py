"""Capability flags (seed: the LayerCapabilities trait family), with the seed's defaults.

A layer class overrides the flags that differ; the model combines them across layers (see
`combine_capabilities`).
"""

from __future__ import annotations

import dataclasses


class LayerCapabilities:
    """Class-level flags every layer answers; values here are the seed's defaults."""

    is_ssm_layer: bool = False
    uses_ssm_pool: bool = False
    supports_replay_tail_split: bool = False
    decode_graph_unsupported: bool = False
    decode_multi_seq_unsupported: bool = False
    decode_verify_multi_unsupported: bool = False
    decode_rollback_unsupported: bool = False
    graph_stale_on_new_sequence: bool = False
    uses_local_mla_prefill: bool = False
    fp8_calibration_frozen: bool | None = None
    has_aux_state: bool = False
    # for the block loop (layers/stack.py): which field of stack.Pools the block keeps its state in, and the
    # name of its jax.named_scope (kind + layer index)
    pool_field: str | None = None
    block_kind: str = "block"

    @property
    def block_name(self) -> str:
        return f"{self.block_kind}{self.layer_idx}"

    @property
    def config(self):
        """The model's ModelConfig. Kept as `_config` so that a model's repr / treescope view shows it once (on
        the model), not inside every block."""
        return self._config


@dataclasses.dataclass(frozen=True)
class ModelCapabilities:
    """What the model decides from its layers' flags."""

    decode_graph_veto: bool           # any layer: decode runs eagerly
    multi_seq_per_sequence: bool      # any layer: batched decode falls back to per-sequence
    verify_per_sequence: bool         # any layer: batched verify falls back to per-sequence
    rollback_unsupported: bool        # any layer: rollback is declined
    stale_on_new_sequence: bool       # any layer: a slot's executables are dropped on a new sequence
    replay_tail_capture: bool         # every layer: in-pass replay-tail capture is planned
    graphs_ready_after_fp8_cal: bool  # no layer reports an unfrozen FP8 calibration
    has_aux_state: bool               # any layer: snapshots carry aux state


def combine_capabilities(layers) -> ModelCapabilities:
    layers = list(layers)
    return ModelCapabilities(
        decode_graph_veto=any(l.decode_graph_unsupported for l in layers),
        multi_seq_per_sequence=any(l.decode_multi_seq_unsupported for l in layers),
        verify_per_sequence=any(l.decode_verify_multi_unsupported for l in layers),
        rollback_unsupported=any(l.decode_rollback_unsupported for l in layers),
        stale_on_new_sequence=any(l.graph_stale_on_new_sequence for l in layers),
        replay_tail_capture=all(l.supports_replay_tail_split for l in layers),
        graphs_ready_after_fp8_cal=not any(l.fp8_calibration_frozen is False for l in layers),
        has_aux_state=any(l.has_aux_state for l in layers),
    )
