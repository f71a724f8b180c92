"""A tensor-parallel worker (ranks 1..N-1): it holds its shard of the model and its KV heads, and runs the forward
of every step rank 0 plans; scheduler, block manager, sampler and drafter live on rank 0 alone.

Started as `python -m engine.distributed.worker_main` with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): by rank 0 itself (launch.py, "spawned") or by torchrun. It connects to rank 0's
control listener (its address is in the rendezvous store), then follows rank 0's messages, each a tuple of
plain values encoded with `marshal`:

    rank 0 -> worker  ("args", {...}) ("profile",) ("cache", num_blocks, max_len) ("warmup",) ("capture",)
                      ("exec", header, timed, graphed) followed by a broadcast of the step's packed tensors
                      ("close",)
    worker -> rank 0  ("joining", rank, local_rank, pid, host) ("loaded", weight bytes) ("blocks", n)
                      ("timings", {region: seconds}) after a timed step, ("error", traceback)
"""
from __future__ import annotations

import marshal
import os
import socket
import threading
import time
import traceback
from pathlib import Path

import torch

from engine.distributed.launch import EnvLaunch, connect_control, env_launch, open_store
from engine.distributed.parallel_state import TensorParallel, abort_group, init_group
from engine.runtime.gc_utils import freeze_gc_heap

PARENT_ENV = "KVSCOPE_TP_PARENT"      # set by rank 0 when it spawns the worker: exit when that process is gone


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
                           logits_indices=lg, q_lens=list(q_lens), seq_lens_cpu=list(seq_lens), max_seqlen_q=max_q,
                           max_seqlen_k=max_k, block_size=block_size)
    return ids, md


def send(conn, *msg) -> None:
    conn.send_bytes(marshal.dumps(msg))


def recv(conn) -> tuple:
    return marshal.loads(conn.recv_bytes())


def _watch_parent(ppid: int) -> None:
    """Exit when the engine process that spawned this one is gone (a collective waiting on it might never
    return)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(1)


def run_worker(launch: EnvLaunch) -> int:
    """Serve rank 0 until it closes the engine; the process's exit code."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    store = open_store(launch, launch.world_size)
    conn = connect_control(store)
    try:
        send(conn, "joining", launch.rank, launch.local_rank, os.getpid(), socket.gethostname())
        _serve(launch, store, conn)
    except (EOFError, ConnectionError, KeyboardInterrupt):       # rank 0 went away
        abort_group(force=True)
        return 0
    except BaseException:
        try:
            send(conn, "error", traceback.format_exc())
        except Exception:
            pass
        traceback.print_exc()
        abort_group(force=True)
        os._exit(1)
    abort_group()
    return 0


def _serve(launch: EnvLaunch, store, conn) -> None:
    from engine.config import EngineConfig
    from engine.core.sizing import derive_num_blocks, profile_step_bytes, resident_bytes
    from engine.kernels.ops import get_ops
    from engine.models.config import ModelArchConfig
    from engine.models.loader import build_model
    from engine.worker.model_runner import ModelRunner
    from engine.worker.timing import NullTimer, make_timer

    kind, args = recv(conn)
    assert kind == "args", kind
    torch.set_num_threads(args["threads"])
    config = EngineConfig(**args["config"])
    device = torch.device(args["device"])
    dtype = getattr(torch, args["dtype"])
    tp: TensorParallel = init_group(launch.rank, launch.world_size, store, device,
                                    not config.parallel_config.disable_custom_all_reduce)
    ops = get_ops(args["kernels"])
    weights = None if args["weights"] is None else Path(args["weights"])
    model = build_model(args["hf_config"], weights, ops, device, dtype, max_pos=args["max_pos"],
                        seed=config.model_config.seed, tp=tp, quantization=config.model_config.quantization,
                        fp8_activations=args["fp8_activations"], int4_group_size=config.model_config.int4_group_size)
    if model.quantization:
        from engine.quant.linear import set_fp8_gemm, set_packed, set_tensor_cores
        set_packed(model, args["quant_packed"], config.kernel_config.quant_gemm_group_dots)
        set_tensor_cores(model, args["quant_tensor_cores"])
        set_fp8_gemm(model, config.kernel_config.fp8_gemm)
    model.gemv_max_tokens, model.gemv_pdl = args["gemv_max_tokens"], args["gemv_pdl"]
    model.set_kernel_options(config)
    send(conn, "loaded", sum(p.numel() * p.element_size() for p in model.parameters()))
    mcfg = ModelArchConfig.from_hf(args["hf_config"])
    runner = None
    timer = make_timer(True, device)
    while True:
        msg = recv(conn)
        kind = msg[0]
        if kind == "exec":
            header, timed, graphed = msg[1], msg[2], msg[3]
            T, B, W, L = header[:4]
            buf = torch.empty(sum(packed_sizes(T, B, W, L)), dtype=torch.int64, device=device)
            tp.broadcast(buf)
            ids, md = unpack(buf, header, runner.block_size)
            runner.set_timer(timer if timed else NullTimer())
            timer.start_step()
            runner.forward(ids, md, graphed)
            if timed:
                send(conn, "timings", timer.collect())
        elif kind == "profile":             # the KV blocks this rank's memory holds (rank 0 takes the min)
            step_bytes = profile_step_bytes(model, mcfg, config, device, dtype, args["max_pos"])
            send(conn, "blocks", derive_num_blocks(config, model.cfg, device, dtype, resident_bytes(model), step_bytes))
        elif kind == "cache":
            if config.scheduler_config.max_num_seqs is None:        # as rank 0 derives it from the same pool
                from engine.core.sizing import derive_max_num_seqs
                config = config.replace(max_num_seqs=derive_max_num_seqs(msg[1], config.cache_config.block_size))
            runner = ModelRunner(model, mcfg, config, device, dtype, msg[1], msg[2])
            freeze_gc_heap()
        elif kind == "warmup":
            runner.warmup_attention()
        elif kind == "capture":
            from engine.worker.cuda_graphs import CudaGraphRunner
            runner.graphs = CudaGraphRunner(runner, config)
            runner.graphs.capture()
            freeze_gc_heap()
            send(conn, "captured")
        elif kind == "close":
            if runner is not None and runner.graphs is not None:
                runner.graphs.release()
            return
        else:
            raise ValueError(f"tensor parallel worker: unknown message {kind!r}")


def serve_if_worker(launch: EnvLaunch | None = None) -> None:
    """Under torchrun, on ranks other than 0: serve as a tensor-parallel worker until rank 0's engine closes,
    then exit the process. The entry points (LLMEngine, the servers) call it first, so one command starts
    every rank: `torchrun ... -m engine.entrypoints.openai.api_server --tensor-parallel-size 2`."""
    launch = env_launch() if launch is None else launch
    if launch is None or launch.rank == 0:
        return
    raise SystemExit(run_worker(launch))


def main() -> None:
    launch = env_launch()
    if launch is None or launch.rank == 0:
        raise SystemExit("engine.distributed.worker_main: run as a rank > 0 of a launch (RANK, WORLD_SIZE, "
                         "LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, as torchrun does)")
    raise SystemExit(run_worker(launch))
