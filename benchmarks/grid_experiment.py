"""What the GEMM grid's empty programs cost at decode sizes (sessions 8 and 9).

The grouped GEMMs launch a grid sized on the host for the worst case (``max_blocks`` row
blocks: every route in its own expert), so at 16 tokens of DeepSeek-V3 EP8 FC1 launches
32 x 40 x 7 = 8960 programs of which about 900 have rows; the rest wait for the sort
(PDL), read their block's expert and exit. This times ``expert_gemms`` (FC1, FC2) four
ways on the same sorted routes:

- full: the worst-case 3-D grid with the row blocks before the K segments
  (``TritonOptions(blocks_last=False)``, the library's grid up to session 9);
- trim: that grid with the tile schedule cut to its valid blocks (the sort's
  ``valid_blocks``, read with a host sync outside the timing), so it has no empty
  programs;
- empty: the full grid with every block marked empty: the empty programs alone;
- blast: the library's default since session 9 (``blocks_last``): the same worst-case
  grid as (tiles, segments, blocks), so the empty programs come after every valid unit.

full, trim and blast must give the same bits.

    PYTHONPATH=src python3 benchmarks/grid_experiment.py --tokens 1 16 64 --out grid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from fp4moe.bench import PRESETS, make_routes, random_experts, time_us
from fp4moe.kernels.launch import TritonOptions, expert_gemms, gemm_configs, use_pdl
from fp4moe.kernels.sort import sort_routes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3-ep8")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="grid.json")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    torch.manual_seed(0)
    e = p.local_experts
    ex = random_experts(p)
    opt_b = TritonOptions(valid_fraction=p.local_experts / p.experts)
    opt = TritonOptions(valid_fraction=p.local_experts / p.experts, blocks_last=False)
    assert opt_b.blocks_last, "blocks_last is the default"
    rows = []
    for t in a.tokens:
        x = torch.randn(t, p.hidden, device="cuda").to(torch.bfloat16)
        ids, w = make_routes(p, t, t, "cuda")
        n_routes = ids.numel()
        cfg1, cfg2 = gemm_configs(n_routes, ex, "w4a16", opt)
        assert cfg1.block_m == cfg2.block_m
        sort = sort_routes(ids.to(torch.int32).contiguous(), e, cfg1.block_m)
        be = sort.block_expert.cpu()
        nvb = int(sort.valid_blocks)
        assert nvb == int((be >= 0).sum()), "valid_blocks is not the count of valid blocks"
        assert bool((be[:nvb] >= 0).all()), "valid blocks are not first"
        trim = dataclasses.replace(
            sort,
            block_expert=sort.block_expert[:nvb].clone(),
            block_start=sort.block_start[:nvb].clone(),
            block_end=sort.block_end[:nvb].clone(),
        )
        empty = dataclasses.replace(sort, block_expert=torch.full_like(sort.block_expert, -1))
        wf = w.reshape(-1).contiguous()
        pdl = use_pdl(opt, x.device)
        n_valid = int(sort.expert_offsets[-1])

        def call(s, o=opt):
            return lambda: expert_gemms(
                s, x, None, None, ex, cfg1=cfg1, cfg2=cfg2, mode="w4a16",
                act_scale="per_token", topk=p.top_k, a_gather=True, route_weights=wf,
                options=o, pdl=pdl,
            )  # fmt: skip

        r_full = call(sort)()[:n_valid].clone()
        r_trim = call(trim)()[:n_valid].clone()
        r_blast = call(sort, opt_b)()[:n_valid].clone()
        same = bool(torch.equal(r_full, r_trim)) and bool(torch.equal(r_full, r_blast))
        row = {"tokens": t, "valid_rows": n_valid, "blocks": sort.num_blocks, "valid_blocks": nvb,
               "cfg1": str(cfg1), "cfg2": str(cfg2), "same": same}  # fmt: skip
        for name, s, o in (("full", sort, opt), ("trim", trim, opt), ("empty", empty, opt),
                           ("blast", sort, opt_b)):  # fmt: skip
            row[name + "_us"] = time_us(call(s, o), graph=True, warmup=3, iters=a.iters)
        print(
            f"T={t:5d} blocks {nvb}/{sort.num_blocks} same {same}  full {row['full_us']:.1f}"
            f"  trim {row['trim_us']:.1f}  empty-only {row['empty_us']:.1f}"
            f"  blocks-last {row['blast_us']:.1f} us",
            flush=True,
        )
        rows.append(row)
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
