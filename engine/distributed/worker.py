"""A tensor-parallel worker process (ranks 1..N-1): it holds its shard of the model and its KV heads, and runs
the forward of every step rank 0 plans; scheduler, block manager and sampler live on rank 0 alone.

Messages from rank 0 over the pipe (executor.py): ("cache", num_blocks, max_len), ("warmup",), ("capture",),
("exec", header) followed by a broadcast of the step's packed tensors, ("close",). Back to rank 0:
("joining",), ("loaded",), ("timings", {region: seconds}) after a timed step, ("error", traceback).
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path

import torch

from engine.distributed.parallel_state import TensorParallel, abort_group, init_group, rank_device

# the step's int64 tensors, packed in this order: [ids T | positions T | slots T | logits L | cu_q B+1 |
# seq_lens B | block tables B*W]
def packed_sizes(T: int, B: int, W: int, L: int) -> list[int]:
    return [T, T, T, L, B + 1, B, B * W]


def unpack(buf: torch.Tensor, header: tuple, block_size: int):
    """The packed step (rank 0's ModelRunner.prepare output) -> (input_ids [T], AttentionMetadata)."""
    from engine.kernels.metadata import AttentionMetadata
    T, B, W, L, q_lens, seq_lens, max_q, max_k = header
    ids, pos, slots, lg, cu, lens, tab = buf.split(packed_sizes(T, B, W, L))
    md = AttentionMetadata(positions=pos, slot_mapping=slots, cu_seqlens_q=cu.to(torch.int32),
                           seq_lens=lens.to(torch.int32), block_tables=tab.view(B, W).to(torch.int32),
                           logits_indices=lg, q_lens=q_lens, seq_lens_cpu=seq_lens, max_seqlen_q=max_q,
                           max_seqlen_k=max_k, block_size=block_size)
    return ids, md


def _watch_parent(ppid: int) -> None:
    """Exit when the engine process is gone (a collective waiting on it might never return)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(1)


def worker_main(rank: int, size: int, port: int, args: dict, conn) -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        _serve(rank, size, port, args, conn)
    except (EOFError, KeyboardInterrupt):       # rank 0 went away
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        abort_group(force=True)
        os._exit(1)
    abort_group()


def _serve(rank: int, size: int, port: int, args: dict, conn) -> None:
    from engine.config import EngineConfig
    from engine.kernels.ops import get_ops
    from engine.worker.model_runner import ModelRunner
    from engine.models.config import ModelArchConfig
    from engine.models.loader import build_model
    from engine.worker.timing import NullTimer, make_timer

    torch.set_num_threads(args["threads"])
    config = EngineConfig(**args["config"])
    device = rank_device(torch.device(args["device"]), rank)
    dtype = getattr(torch, args["dtype"])
    conn.send(("joining",))
    store = torch.distributed.TCPStore("127.0.0.1", port, size, False)
    tp: TensorParallel = init_group(rank, size, store, device)
    ops = get_ops(args["kernels"])
    weights = None if args["weights"] is None else Path(args["weights"])
    model = build_model(args["hf_config"], weights, ops, device, dtype, max_pos=args["max_pos"],
                        seed=config.model_config.seed, tp=tp)
    model.gemv_max_tokens, model.gemv_pdl = args["gemv_max_tokens"], args["gemv_pdl"]
    model.set_kernel_options(config)
    conn.send(("loaded",))
    mcfg = ModelArchConfig.from_hf(args["hf_config"])
    runner = None
    timer = make_timer(True, device)
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "exec":
            header, timed = msg[1], msg[2]
            T, B, W, L = header[:4]
            buf = torch.empty(sum(packed_sizes(T, B, W, L)), dtype=torch.int64, device=device)
            tp.broadcast(buf)
            ids, md = unpack(buf, header, runner.block_size)
            runner.set_timer(timer if timed else NullTimer())
            timer.start_step()
            runner.execute(ids, md)
            if timed:
                conn.send(("timings", timer.collect()))
        elif kind == "cache":
            if config.scheduler_config.max_num_seqs is None:        # as rank 0 derives it from the same pool
                from engine.core.sizing import derive_max_num_seqs
                config = config.replace(max_num_seqs=derive_max_num_seqs(msg[1], config.cache_config.block_size))
            runner = ModelRunner(model, mcfg, config, device, dtype, msg[1], msg[2])
        elif kind == "warmup":
            runner.warmup_attention()
        elif kind == "capture":
            from engine.worker.cuda_graphs import CudaGraphRunner
            runner.graphs = CudaGraphRunner(runner, config)
            runner.graphs.capture()
        elif kind == "close":
            return
        else:
            raise ValueError(f"tensor parallel worker: unknown message {kind!r}")
