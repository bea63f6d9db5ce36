"""Host emulation of the Hopper forward's arithmetic (forward_sm90_softmax.cuh, _epilogue.cuh) for
its two ways of taking the softmax row sums l, against FP64 (issue 29):

  ones: l from the ones column of O = P [V | 1], i.e. the fp32 sum of P rounded to bf16/fp16;
  fp32: l from the fp32 P in registers, per thread over its columns of the accumulator layout
        (8 j + 2 (lane % 4) + {0, 1}), a fixed tree per tile, rescaled with O, quad-summed at the
        end (the kernel since issue 29).

Per 64-key tile and row, as the kernel: the row maximum, the lazy rescale (m moves only when the
tile's maximum exceeds it by more than 8 log2 units; O and l multiplied by the same factor), p =
2^(acc c - m c) in fp32 (the exp2 exact here: the MUFU's and the polynomial's errors, ~1e-6, are
not modelled), P rounded to the input dtype for the PV product (fp32 accumulation), O = o (1 / l)
rounded to the output dtype, lse = m |scale| + ln(l) in fp32. Inputs like bench/attention.py: q,
k, v, bias ~ N(0, 1) in bf16, scale 1 / sqrt(D), the last S/8 keys masked, plus random masked keys.

It checks that every key's P enters exactly one thread's partial sum of its row (the fragment
map), and prints O's rel L2 (%) and the worst |lse - FP64| of both ways: the numbers the GPU run
of the fp32 way should reproduce (the lse to ~1e-6; O to the second digit). CPU only (torch):
  python bench/emulate_fwd90_rowsums.py [--D 32] [--S 384] [--slices 16] [--dtype bf16]
                                       [--rescale-log2 8] [--exact-p]
Results (D = 32, S = 384, 8 slices, bf16, seed 0): threshold 8 (the kernel): O 0.2194 % (ones),
0.2272 % (fp32), lse 1.4e-3 / 7.8e-7; threshold 0: O 0.1991 / 0.2003 %, lse 6.2e-4 / 8.4e-7;
exact P: 0.1655 % (the output rounding alone). So the fp32 row sums fix the lse but make O a
little worse (its error term is sum_k P_k d_k v_k in place of sum_k P_k d_k (v_k - O)); O's 10 %
above SDPA comes from the lazy rescale: with it a row's largest P is not 1 and is rounded too.
"""
import argparse
import math

import torch

KEYS = 64
RESCALE_LOG2 = 8.0


def f32(x):
    return x.to(torch.float32)


def emulate(q, k, v, bias, keep, scale, dtype, rescale_log2=RESCALE_LOG2, exact_p=False):
    """q, k, v [S, D] and bias [S, S] as float64 holding dtype values; keep [S] bool. Returns
    (O_ones, lse_ones, O_fp32, lse_fp32), O in the output dtype as float64."""
    S, D = q.shape
    c = f32(torch.tensor(abs(scale) * 1.4426950408889634))
    scale_abs = f32(torch.tensor(abs(scale)))
    inv_scale = f32(torch.tensor(1.0 / abs(scale)))
    sign = 1.0 if scale > 0 else -1.0
    # acc = bias / |scale| (fp32, the pre-pass) + q.k (fp32 MMA), masked keys -inf.
    acc = f32(f32(bias) * inv_scale) + f32(sign * q.float() @ k.float().T)
    acc[:, ~keep] = -math.inf
    tiles = -(-S // KEYS)
    rows = S
    m = torch.full((rows,), -math.inf, dtype=torch.float32)
    o = torch.zeros(rows, D, dtype=torch.float32)
    l_ones = torch.zeros(rows, dtype=torch.float32)
    l_part = torch.zeros(rows, 4, dtype=torch.float32)  # [row, lane % 4]
    seen = torch.zeros(rows, S, dtype=torch.int32)       # how often each P entered some l_part
    rescale_acc = f32(torch.tensor(rescale_log2)) / c
    for t in range(tiles):
        k0 = t * KEYS
        a = torch.full((rows, KEYS), -math.inf, dtype=torch.float32)
        n = min(KEYS, S - k0)
        a[:, :n] = acc[:, k0:k0 + n]
        mx = a.max(dim=1).values
        need = mx > f32(m + rescale_acc)
        corr = torch.where(need, torch.exp2(f32(f32(m - mx) * c)), torch.ones_like(m))
        corr = torch.where(need & torch.isinf(m), torch.zeros_like(m), corr)
        m = torch.where(need, mx, m)
        o = f32(o * corr[:, None])
        l_ones = f32(l_ones * corr)
        l_part = f32(l_part * corr[:, None])
        neg = torch.where(torch.isinf(m), torch.zeros_like(m), f32(-m * c))
        x = f32(a.double() * c.double() + neg.double()[:, None])  # the FFMA: one rounding
        p = torch.exp2(x)
        p = torch.where(torch.isinf(x) & (x < 0), torch.zeros_like(p), p)
        # fp32 partial sums: lane % 4 = qd holds columns 8 j + 2 qd + {0, 1}.
        for qd in range(4):
            cols = [8 * j + 2 * qd + e for j in range(KEYS // 8) for e in (0, 1)]
            for col in cols:
                if col < n:
                    seen[:, k0 + col] += 1
            tt = [f32(p[:, 8 * j + 2 * qd] + p[:, 8 * j + 2 * qd + 1]) for j in range(KEYS // 8)]
            w = KEYS // 16
            while w >= 1:
                for j in range(w):
                    tt[j] = f32(tt[j] + tt[j + w])
                w //= 2
            l_part[:, qd] = f32(l_part[:, qd] + tt[0])
        pr = p.clone() if exact_p else p.to(dtype).float()  # P rounded for the MMA
        vt = torch.zeros(KEYS, D, dtype=torch.float32)
        vt[:n] = v[k0:k0 + n].float()
        o = f32(o + pr @ vt)
        l_ones = f32(l_ones + pr.sum(dim=1))
    assert (seen == 1).all(), "a key's P entered no or several partial row sums"
    l_fp32 = f32(f32(l_part[:, 0] + l_part[:, 1]) + f32(l_part[:, 2] + l_part[:, 3]))

    def finish(l):
        inv = torch.where(l > 0, 1.0 / l, torch.zeros_like(l)).float()
        out = f32(o * inv[:, None]).to(dtype).double()
        lse = torch.where(l > 0, f32(f32(m * scale_abs) + torch.log(l)),
                          torch.full_like(l, math.inf)).double()
        return out, lse

    return (*finish(l_ones), *finish(l_fp32))


def reference(q, k, v, bias, keep, scale):
    s = scale * (q @ k.T) + bias
    s[:, ~keep] = -math.inf
    lse = torch.logsumexp(s, dim=1)
    p = torch.exp(s - lse[:, None])
    p = torch.nan_to_num(p, nan=0.0)
    return p @ v, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=32)
    ap.add_argument("--S", type=int, default=384)
    ap.add_argument("--slices", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rescale-log2", type=float, default=RESCALE_LOG2,
                    help="the lazy rescale's threshold (the kernel's kRescaleLog2; 0: every new max)")
    ap.add_argument("--exact-p", action="store_true", help="no rounding of P for the PV product")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator().manual_seed(args.seed)
    S, D = args.S, args.D
    scale = 1 / math.sqrt(D)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).double()

    bias = randn(S, S)  # one head: shared by the slices
    err = {"ones": [0.0, 0.0, 0.0], "fp32": [0.0, 0.0, 0.0]}  # |dO|^2, |O|^2, max |d lse|
    for _ in range(args.slices):
        q, k, v = randn(S, D), randn(S, D), randn(S, D)
        keep = (torch.rand(S, generator=g) > 0.1) & (torch.arange(S) < S - S // 8)
        o1, lse1, o2, lse2 = emulate(q, k, v, bias, keep, scale, dtype, args.rescale_log2,
                                      args.exact_p)
        ref_o, ref_lse = reference(q, k, v, bias, keep, scale)
        for name, o_, lse_ in (("ones", o1, lse1), ("fp32", o2, lse2)):
            err[name][0] += ((o_ - ref_o) ** 2).sum().item()
            err[name][1] += (ref_o ** 2).sum().item()
            fin = torch.isfinite(ref_lse)
            err[name][2] = max(err[name][2], (lse_[fin] - ref_lse[fin]).abs().max().item())
    print(f"D={D} S={S} slices={args.slices} {args.dtype} rescale threshold {args.rescale_log2}"
          f"{' exact P' if args.exact_p else ''}: every P in exactly one partial row sum")
    for name, (d2, r2, lse_max) in err.items():
        print(f"  l from {name:4}: O rel L2 {100 * math.sqrt(d2 / r2):.4f} %, "
              f"max |lse - FP64| {lse_max:.3e}")


if __name__ == "__main__":
    main()
