"""Stage-by-stage comparison of the Triton path against the reference on the GPU (debug aid)."""

import torch

import fp4moe
from fp4moe.kernels import launch
from fp4moe.kernels.quantize import MODE_PER_ROW
from fp4moe.nvfp4 import quantize_nvfp4
from fp4moe.reference import moe_reference

torch.manual_seed(0)
E, H, I, T, K = 4, 7168, 2048, 16, 2
w13 = torch.randn(E, 2 * I, H, device="cuda") * 0.02
w2 = torch.randn(E, H, I, device="cuda") * 0.02
ex = fp4moe.prepare_experts(w13, w2)
x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
c, s, g = launch.quantize_rows(x, T, mode=MODE_PER_ROW, pdl=False)
q = quantize_nvfp4(x, per_row=True)
print(
    "per-row quant codes",
    torch.equal(c, q.codes),
    "scales",
    torch.equal(s.view(torch.uint8), q.scales.view(torch.uint8)),
    "global",
    torch.equal(g, q.global_scale),
)
if not torch.equal(c, q.codes):
    d = (c != q.codes).nonzero()
    print("code diffs", d.shape[0], d[:5])
# subnormal fp16 in dot: compare fp16 dot on tiny values
a = torch.randint(1, 8, (64, 64), device="cuda").half() * 2**-20
b = torch.randn(64, 64, device="cuda").half()
print(
    "fp16 subnormal matmul ok:",
    torch.allclose((a @ b).float(), a.float() @ b.float(), rtol=1e-3, atol=0),
)
ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().cuda()
w = torch.rand(T, K, device="cuda")
for sc in ["per_token", "per_tensor", "static"]:
    if sc == "static":
        ex = fp4moe.prepare_experts(
            w13, w2, a13_scale=torch.full((E,), 5.0 / 2688), a2_scale=torch.full((E,), 0.5 / 2688)
        )
    for pdl in [False, True]:
        out = launch.moe_triton(
            x, ids, w, ex, mode="w4a4", act_scale=sc, options=launch.TritonOptions(pdl=pdl)
        )
        ref = moe_reference(x, ids, w, ex, mode="w4a4", act_scale=sc)
        print(
            sc,
            "pdl",
            pdl,
            "rel",
            ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
            "ref norm",
            ref.float().norm().item(),
        )
out = launch.moe_triton(x, ids, w, ex, mode="w4a16")
ref = moe_reference(x, ids, w, ex, mode="w4a16")
print("w4a16 rel", ((out.float() - ref.float()).norm() / ref.float().norm()).item())
