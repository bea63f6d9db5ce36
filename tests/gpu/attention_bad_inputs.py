"""The CUDA half of test_bad_input_names_the_argument_on_cuda, run as its own process: each of
attention_cases.BAD_INPUTS through triangle_attention on CUDA tensors (bfloat16, float16) with a
gradient to come; prints each case before it runs and, at the end, ROWS and a JSON list of
[dtype, case, expected message, message raised or None]."""
import faulthandler
import json

import torch

import tpfkit as tpf
from attention_cases import BAD_INPUTS, bad_input_message, make_case

faulthandler.enable()
rows = []
for dtype in (torch.bfloat16, torch.float16):
    g = torch.Generator().manual_seed(0)
    q, k, v, b, m, _ = make_case(1, 3, 2, 6, 8, dtype, "cuda", g)
    for i, (template, mutate) in enumerate(BAD_INPUTS):
        print("CASE", dtype, i, template, flush=True)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, b)]
        try:
            tpf.triangle_attention(*mutate(*leaves, m)).sum().backward()
            torch.cuda.synchronize()
            got = None
        except (ValueError, TypeError) as e:
            got = str(e)
        rows.append([str(dtype), i, bad_input_message(template, q), got])
print("ROWS" + json.dumps(rows))
