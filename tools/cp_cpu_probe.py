"""Does torch's context_parallel run on CPU gloo ranks? (docs/parallelism.md, "Context parallelism")

Two spawned gloo ranks build a 1-layer transformers Llama (SDPA attention, fp32), enter
torch.distributed.tensor.experimental.context_parallel with input_ids, labels and position_ids as
buffers (seq dim 1, 16 tokens: the head-tail load balancer is on) and run one forward and
backward, under each SDPA backend choice given on the command line (default: none forced).
Each rank prints OK with its loss, or FAIL with the exception. With torch 2.13 every choice fails
(the ring dispatches SDPA's CUDA ops only), which is why context parallelism is mirrored from
the source and not measured.

    .venv/bin/python tools/cp_cpu_probe.py [default|FLASH_ATTENTION|EFFICIENT_ATTENTION|MATH ...]
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys


def _rank(rank: int, world: int, port: int, backend: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (world,))
        ids = torch.randint(0, 128, (1, 16))
        labels = ids.clone()
        positions = torch.arange(16).unsqueeze(0)
        kernel = contextlib.nullcontext() if backend == "default" else sdpa_kernel([getattr(SDPBackend, backend)])
        with context_parallel(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]), kernel:
            out = model(input_ids=ids, labels=labels, position_ids=positions)
            out.loss.backward()
        print(f"rank {rank} {backend}: OK, loss {out.loss.item():.5f}", flush=True)
    except Exception as e:  # the point of the probe: report it
        print(f"rank {rank} {backend}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    for backend in argv or ["default"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, backend), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1:])
