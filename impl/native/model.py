"""The native DeepSeek-V4 model on Megatron-Core.

Computation: ``docs/reference/v4_architecture.md`` §5.1; parameter names: ``docs/DESIGN.md``. A pipeline stage builds
a subset of the layers and keeps their global numbers in the parameter names. The module order and how stages hand
on their streams: :class:`DeepseekV4NativeModel`."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split
from collections.abc import Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from torch import nn

from impl.errors import UnsupportedConfigError
from impl.native.activations import ActivationPlan, recompute
from impl.native.config import V4Config
from impl.native.hyper import HyperHead
from impl.native.layer import DeepseekV4DecoderLayer
from impl.native.moe import expert_parallel_layout
from impl.native.mtp import DeepseekV4MTPBlock
from impl.native.norm import RMSNorm
from impl.native.parallel import (
    megatron_parallel_config,
    normal_init,
    place_on_init_device,
    resolve_tp_group,
    vocab_parallel_loss,
)

__all__ = [
    "DeepseekV4NativeModel",
    "validate_parallel_layout",
]


def validate_parallel_layout(config: V4Config, *, tp_size: int, ep_size: int) -> None:
    """Raise :class:`UnsupportedConfigError` (before anything is built) for a layout the native graph cannot shard."""
    if tp_size < 1 or config.vocab_size % tp_size != 0:
        raise UnsupportedConfigError(
            f"vocab_size={config.vocab_size} is not divisible by tensor_model_parallel_size={tp_size} "
            "(embedding and output_layer split the vocabulary evenly); pad the vocabulary or change TP"
        )
    if config.num_heads % tp_size != 0 or config.o_groups % tp_size != 0:
        raise UnsupportedConfigError(
            f"tensor_model_parallel_size={tp_size} must divide num_heads={config.num_heads} and "
            f"o_groups={config.o_groups} (attention splits whole heads and output groups); change TP"
        )
    expert_parallel_layout(config, ep_size)


def _run_layers(
    layers: Sequence[nn.Module], input_ids: torch.Tensor, position_ids: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    for layer in layers:
        x = layer(x, input_ids, position_ids)
    return x


class GlobalLayerList(nn.ModuleList):
    """A ``ModuleList`` whose children are registered under their GLOBAL layer numbers (``decoder.layers.7``).

    Iteration, ``len`` and integer indexing are positional (this stage's layers in order). Bare modules
    (as Megatron-Bridge's PEFT walk passes when it rebuilds a list) are registered under their own
    ``layer_number``, so wrapping a stage in LoRA keeps its global names.
    """

    def __init__(self, layers: Sequence[tuple[int, nn.Module] | nn.Module] = ()) -> None:
        super().__init__()
        for item in layers:
            number, layer = (item.layer_number, item) if isinstance(item, nn.Module) else item
            self.add_module(str(number), layer)

    def __getitem__(self, idx: int) -> nn.Module:  # type: ignore[override]
        return list(self._modules.values())[idx]

    @property
    def layer_numbers(self) -> list[int]:
        return [int(k) for k in self._modules]


class _Embedding(nn.Module):
    def __init__(self, config: V4Config, mp_config, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, init_method=normal_init(), config=mp_config, tp_group=tp_group
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)


class _Decoder(nn.Module):
    def __init__(
        self, layers: GlobalLayerList, config: V4Config, post_process: bool, params_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layers = layers
        if post_process:
            self.hc_head_params = HyperHead(config)
            self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)


def _ep_size() -> int:
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_expert_model_parallel_world_size()
    return 1


class DeepseekV4NativeModel(MegatronModule):
    """DeepSeek-V4 on Megatron-Core parallel layers and process groups (TP over vocab/heads, EP over experts).

    ``forward(input_ids [B,S], position_ids=None, *, labels=None)`` returns full-vocabulary fp32 logits
    ``[B, S, V]`` or, with ``labels``, the per-token cross-entropy ``[B, S]``; a stage without
    ``post_process`` returns its stream tensor ``[B, S, hc_mult, d]``.

    ``embedding.word_embeddings`` (vocab split over TP) -> ``hc_mult`` identical streams -> ``decoder.layers`` ->
    ``decoder.hc_head_params`` (stream collapse) -> ``decoder.final_layernorm`` -> ``output_layer`` (vocab split
    over TP). A pipeline stage builds a subset of the layers (``layer_numbers``), keeping their global numbers in
    the parameter names; a stage without ``pre_process`` takes the previous stage's stream tensor via
    :meth:`set_input_tensor`.
    """

    def __init__(
        self,
        config: V4Config,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Sequence[int] | None = None,
        include_mtp: bool | None = None,
        tp_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        activations: ActivationPlan | None = None,
    ) -> None:
        tp_group, tp_size, _ = resolve_tp_group(tp_group)
        validate_parallel_layout(config, tp_size=tp_size, ep_size=_ep_size())
        numbers = list(range(config.num_layers)) if layer_numbers is None else [int(n) for n in layer_numbers]
        bad = [n for n in numbers if not 0 <= n < config.num_layers]
        if bad or len(set(numbers)) != len(numbers):
            raise UnsupportedConfigError(
                f"layer_numbers {numbers} must be distinct decoder layers in [0, {config.num_layers}); offending {bad}"
            )
        mp_config = megatron_parallel_config(config, params_dtype=params_dtype, tensor_model_parallel_size=tp_size)
        super().__init__(mp_config)
        self.v4_config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.include_mtp = (post_process and config.num_mtp_layers > 0) if include_mtp is None else bool(include_mtp)
        if self.include_mtp and not post_process:
            raise UnsupportedConfigError("include_mtp needs post_process=True (MTP shares the output head)")
        if self.include_mtp and config.num_mtp_layers < 1:
            raise UnsupportedConfigError("include_mtp=True but the config has num_nextn_predict_layers=0")
        self.tp_group = tp_group
        self.input_tensor: torch.Tensor | None = None
        self.activations = activations = activations or ActivationPlan()

        # MTP needs the embedding on the last stage too (Megatron's shared-embedding arrangement).
        if pre_process or self.include_mtp:
            self.embedding = _Embedding(config, mp_config, tp_group)
        layers = GlobalLayerList(
            [
                (
                    n,
                    DeepseekV4DecoderLayer(
                        config, n, tp_group=tp_group, params_dtype=params_dtype, activations=activations
                    ),
                )
                for n in sorted(numbers)
            ]
        )
        self.decoder = _Decoder(layers, config, post_process, params_dtype)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                config.vocab_size,
                config=mp_config,
                init_method=normal_init(),
                bias=False,
                gather_output=False,
                tp_group=tp_group,
            )
        if self.include_mtp:
            self.mtp = DeepseekV4MTPBlock(config, tp_group=tp_group, params_dtype=params_dtype, activations=activations)
        place_on_init_device(self)  # get_model's later .cuda() is then a no-op

    # -- pipeline plumbing ---------------------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Megatron's pipeline hook: the stream tensor ``[B, S, n, d]`` from the previous stage."""
        if isinstance(input_tensor, list | tuple):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def layers(self) -> Iterator[DeepseekV4DecoderLayer]:
        yield from self.decoder.layers

    # -- forward -------------------------------------------------------------------------------------------------
    @staticmethod
    def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
        return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)

    def forward_streams(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's output stream tensor ``[B, S, hc_mult, d]`` (before ``hc_head``)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        if self.pre_process:
            h = self.embedding(input_ids)
            x = h.unsqueeze(2).expand(-1, -1, self.v4_config.hc_mult, -1).contiguous()
        else:
            if self.input_tensor is None:
                raise ValueError("this pipeline stage has pre_process=False: call set_input_tensor(streams) first")
            x = self.input_tensor
        layers = list(self.decoder.layers)
        for group in self.activations.checkpointed_layers(len(layers)):
            run = partial(_run_layers, [layers[i] for i in group], input_ids, position_ids)
            x = recompute(self.activations.layer_is_recomputed(group[0]), run, x)
        return x

    def _head(self, y: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        logits_parallel, _ = self.output_layer(y)
        if labels is not None:
            return vocab_parallel_loss(logits_parallel.float(), labels, self.tp_group)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            logits_parallel = tensor_parallel.gather_from_tensor_model_parallel_region(
                logits_parallel, group=self.tp_group
            )
        return logits_parallel.float()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.forward_streams(input_ids, position_ids)
        if not self.post_process:
            return x
        y = self.decoder.final_layernorm(self.decoder.hc_head_params(x))
        return self._head(y, labels)

    def forward_mtp(
        self,
        hidden_streams: torch.Tensor,
        next_input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP logits ``[B, S, V]`` (or per-token loss) from the main stream tensor and the next-token ids."""
        if not self.include_mtp:
            raise UnsupportedConfigError("this model was built without MTP (include_mtp=False)")
        if position_ids is None:
            position_ids = self.default_position_ids(next_input_ids)
        y = self.mtp.layers[depth](hidden_streams, next_input_ids, position_ids, self.embedding)
        return self._head(y, labels)
