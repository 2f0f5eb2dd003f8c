"""The GPU check's own step (run by scripts/gpu-check.sh): per block layout and head slice, a
save and a load through the copy engine on a CUDA device, each under
``torch.cuda.set_sync_debug_mode("error")`` (torch raises on any call that would make the
host wait for the device), their bytes compared with the CPU path's, and the copy calls of
each step. Prints one line per case and exits non-zero if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

import hostkv
from hostkv import copy_engine

LAYERS, HEADS, DIM, TOKENS, BLOCKS, PAGES = 4, 8, 64, 16, 24, 32


def builders():
    """Each block layout's engine tensor from a canonical [blocks, kv, tokens, heads, dim]."""
    def vllm(r):
        b, kv, t, h, d = r.shape
        return r.permute(0, 3, 2, 1, 4).reshape(b, h, t, kv * d).contiguous()

    def vllm_nhd_memory(r):
        b, kv, t, h, d = r.shape
        return r.permute(0, 2, 3, 1, 4).reshape(b, t, h, kv * d).contiguous().permute(0, 2, 1, 3)

    return {
        "vllm": (copy_engine.VLLM, vllm, "mha"),
        "vllm-nhd-memory": (copy_engine.VLLM, vllm_nhd_memory, "mha"),
        "flash-attn": (copy_engine.FLASH_ATTN, lambda r: r.permute(1, 0, 2, 3, 4).contiguous(), "mha"),
        "flashinfer-nhd": (copy_engine.FLASHINFER_NHD, lambda r: r.contiguous(), "mha"),
        "flashinfer-hnd": (copy_engine.FLASHINFER_HND,
                           lambda r: r.permute(0, 1, 3, 2, 4).contiguous(), "mha"),
        "mla": (copy_engine.VLLM_MLA, lambda r: r[:, 0].permute(0, 2, 1, 3).contiguous(), "mla"),
    }


def one_case(name, block_layout, build, kind, heads, staging, counter):
    total = 1 if kind == "mla" else HEADS
    dim = 2 * DIM if kind == "mla" else DIM
    layout = hostkv.KVLayout(LAYERS, total, dim, "bfloat16", kind=kind)
    first, stop = heads or (0, total)
    g = torch.Generator().manual_seed(counter)
    ref = [torch.randn(BLOCKS, layout.kv_planes, TOKENS, stop - first, dim, generator=g)
           .to(torch.bfloat16) for _ in range(LAYERS)]
    cpu_tensors = [build(r) for r in ref]
    gpu_tensors = [t.cuda() for t in cpu_tensors]
    cfg = hostkv.HostKVConfig(num_pages=PAGES, page_size=TOKENS, kv_layout=layout)
    names = [f"hostkv-gpucheck-{os.getpid()}-{counter}-{i}" for i in (0, 1)]
    caches = [hostkv.HostKVCache.create(n, cfg.apply_runtime_defaults()) for n in names]
    blocks, pages = [7, 0, 3, 11, 5, 6], [2, 9, 10, 11, 30, 4]   # 10, 11 adjacent
    targets = [1, 12, 13, 20, 21, 2]
    result = {"case": name, "heads": heads, "staging": staging}
    gpu_pool = caches[0].pages_tensor()
    cpu_pool = caches[1].pages_tensor()
    engine = loader = None
    try:
        copy_engine.CopyEngine(cpu_pool, layout, TOKENS, cpu_tensors, block_layout,
                               heads=heads).save(blocks, pages)
        engine = copy_engine.CopyEngine(gpu_pool, layout, TOKENS, gpu_tensors, block_layout,
                                        heads=heads, staging_bytes=staging)
        registration = engine.registration()
        registration.finished.wait(60)
        result["registered"] = registration.registered_bytes == registration.nbytes
        engine.submit_save([0], [0]).wait()                 # first calls, outside the check
        before = engine.stats().copy_calls
        torch.cuda.set_sync_debug_mode("error")
        try:
            save = engine.submit_save(blocks, pages)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result["save_copy_calls"] = engine.stats().copy_calls - before
        save.wait()
        gpu_pool[0].zero_()
        cpu_pool[0].zero_()
        result["save_bytes_exact"] = bool(torch.equal(gpu_pool, cpu_pool))
        back = [torch.zeros_like(t) for t in gpu_tensors]
        loader = copy_engine.CopyEngine(gpu_pool, layout, TOKENS, back, block_layout,
                                        heads=heads, staging_bytes=staging)
        loader.registration().finished.wait(60)
        before = loader.stats().copy_calls
        torch.cuda.set_sync_debug_mode("error")
        try:
            load = loader.submit_load(pages, targets)
            load.wait_all_layers()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result["load_copy_calls"] = loader.stats().copy_calls - before
        torch.cuda.synchronize()
        ok = True
        for layer in range(LAYERS):
            want = torch.zeros_like(ref[layer])
            want[targets] = ref[layer][blocks]
            ok &= bool(torch.equal(back[layer].cpu(), build(want)))
        result["load_bytes_exact"] = ok
        result["pages_a_step"] = len(pages)
        result["ok"] = result["save_bytes_exact"] and result["load_bytes_exact"]
    except Exception:                     # noqa: BLE001 - reported, the others still run
        result["ok"] = False
        result["error"] = traceback.format_exc(limit=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for e in (engine, loader):
            if e is not None:
                e.close()
        del engine, loader, gpu_pool, cpu_pool
        for cache in caches:
            cache.close()
            cache.unlink()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 1
    results = []
    counter = 0
    for name, (block_layout, build, kind) in builders().items():
        slices = [None] if kind == "mla" else [None, (0, HEADS // 2), (HEADS // 2, HEADS)]
        for heads in slices:
            # Default staging (whole), and one page: a step in six pieces.
            for staging in (None, 1):
                counter += 1
                r = one_case(name, block_layout, build, kind, heads, staging, counter)
                results.append(r)
                print(f"{'OK  ' if r['ok'] else 'FAIL'} {name:16} heads={str(heads):8} "
                      f"staging={'one page' if staging else 'default':8} "
                      f"save calls={r.get('save_copy_calls')} load calls="
                      f"{r.get('load_copy_calls')} for {r.get('pages_a_step')} pages x "
                      f"{LAYERS} layers, registered={r.get('registered')}")
                if "error" in r:
                    print(r["error"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
