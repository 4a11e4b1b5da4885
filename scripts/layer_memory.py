"""Memory of one Flash-width decoder layer with LoRA: measured next to impl's memory model (scripts/device_check.sh).

One CSA layer at DeepSeek-V4-Flash width with one EP rank's 32 routed experts, bf16, LoRA r=16 on the five
attention projections, micro-batch 1 x ``--seq`` tokens, forward + backward. Prints the weights, the bytes
autograd keeps (saved-tensor hooks) against ``impl.stage_activation_bytes``, and on CUDA the peak allocated memory.
``--tiny`` uses the tiny-mixed preset instead (the CPU dry run). Exit 1 when the model is off by more than 10 %.

    python scripts/layer_memory.py [--seq 4096] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tiny: bool):
    from tiny_models.presets import CSA, flash_config, get_preset

    if tiny:
        return get_preset("tiny-mixed"), 1
    cfg = flash_config()
    cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, [CSA], ["moe"]
    cfg.n_routed_experts //= 8  # one EP rank's share
    cfg.num_nextn_predict_layers = 0
    return cfg, 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 4096; --tiny: 96)")
    parser.add_argument("--tiny", action="store_true", help="tiny-mixed preset (CPU dry run)")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    import impl
    from fixtures.asserts.saved_tensors import saved_bytes

    impl.compat_report()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no file store
        parallel_state.initialize_model_parallel(1, 1)
    hf, layer = _config(args.tiny)
    cfg = impl.V4Config.from_hf(hf)
    seq = args.seq or (96 if args.tiny else 4096)
    device = impl.rank_device()
    holder = torch.nn.Module()
    holder.layer = impl.DeepseekV4DecoderLayer(cfg, layer, params_dtype=torch.bfloat16)
    impl.apply_lora(holder, targets=["wq_a", "wq_b", "wkv", "wo_a", "wo_b"], rank=16, alpha=32.0)
    holder.to(device)
    params = {t.untyped_storage().data_ptr() for t in [*holder.parameters(), *holder.buffers()]}
    weights = sum(t.numel() * t.element_size() for t in [*holder.parameters(), *holder.buffers()])
    x = torch.randn(1, seq, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, device=device, requires_grad=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    pos = torch.arange(seq, device=device).unsqueeze(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, kept = saved_bytes(lambda: holder.layer(x, ids, pos), params)
    out.float().square().mean().backward()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    shape = impl.ActivationShape(micro_batch=1, seq_len=seq, dtype_bytes=2, lora_rank=16)
    modeled = sum(impl.layer_activation_bytes(cfg, layer, shape).values())
    error = modeled / kept - 1
    print(f"layer {layer} ({'tiny-mixed' if args.tiny else 'Flash width, 32 experts'}), {seq} tokens on {device}")
    print(f"  weights (bf16 + adapters)   {weights / 1e6:10.1f} MB")
    print(f"  kept for backward, measured {kept / 1e6:10.1f} MB")
    print(f"  kept for backward, model    {modeled / 1e6:10.1f} MB  ({error:+.1%})")
    if peak is not None:
        print(f"  CUDA peak allocated         {peak / 1e6:10.1f} MB")
    return 0 if abs(error) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
