"""The client packages' own PairFormer stacks (OpenFold3, Boltz, Protenix), built and run on each
of three paths: the client's PyTorch code ("pytorch"), its cuEquivariance path ("cuequivariance",
the client's kernel switch on) and ours ("ours", turbopairformer.integrations enabled). Shared by
bench/clients.py and the integration tests.

A client's `build(**config)` takes its PairFormer's own argument names; DEFAULTS are its default
configuration (AlphaFold3's widths), blocks aside. `inputs(N, ...)` makes s, z and masks with the
last tokens padded, in the layout the client's stack takes; `run(model, inputs, path)` is one
forward on that path and returns (s, z).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch

PATHS = ("pytorch", "cuequivariance", "ours")


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    integration: str                      # turbopairformer.integrations.<integration>
    defaults: dict                        # its PairFormer's default configuration
    small: dict                           # a small one for CPU tests
    batched: bool                         # whether its stack takes a batch dimension
    build: Callable[..., torch.nn.Module]
    forward: Callable[..., tuple]         # forward(model, inputs, kernels: bool) -> (s, z)

    def integration_module(self):
        return importlib.import_module(f"turbopairformer.integrations.{self.integration}")

    def inputs(self, N: int, c_s: int, c_z: int, *, batch: int = 1, padded: int = 0,
               generator: torch.Generator = None, dtype=torch.float32,
               device="cpu") -> dict[str, torch.Tensor]:
        """s, z and the token and pair masks (float, as the clients take them; the last `padded`
        tokens of the last sample masked), without the batch dimension for a client that has
        none (then batch must be 1)."""
        s = torch.randn(batch, N, c_s, generator=generator, dtype=torch.float64)
        z = torch.randn(batch, N, N, c_z, generator=generator, dtype=torch.float64)
        token = torch.ones(batch, N, dtype=torch.float64)
        if padded:
            token[-1, N - padded:] = 0
        pair = token[:, :, None] * token[:, None, :]
        out = dict(s=s, z=z, token_mask=token, pair_mask=pair)
        if not self.batched:
            assert batch == 1, f"{self.name}'s stack takes no batch dimension"
            out = {k: v[0] for k, v in out.items()}
        return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}

    def run(self, model: torch.nn.Module, inputs: dict, path: str) -> tuple:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        integration = self.integration_module()
        if path == "ours":
            with integration.enabled():
                return self.forward(model, inputs, kernels=False)
        with integration.disabled():
            return self.forward(model, inputs, kernels=path == "cuequivariance")


def _openfold3_build(**config: Any) -> torch.nn.Module:
    from openfold3.core.model.latent.pairformer import PairFormerStack
    return PairFormerStack(**config)


def _openfold3_forward(model, x, kernels):
    return model(x["s"], x["z"], x["token_mask"], x["pair_mask"],
                 use_cueq_triangle_kernels=kernels)


def _boltz_build(**config: Any) -> torch.nn.Module:
    from boltz.model.layers.pairformer import PairformerModule
    return PairformerModule(**config)


def _boltz_forward(model, x, kernels):
    return model(x["s"], x["z"], x["token_mask"], x["pair_mask"], use_kernels=kernels)


def _protenix_build(**config: Any) -> torch.nn.Module:
    from protenix.model.modules.pairformer import PairformerStack
    return PairformerStack(**config)


def _protenix_forward(model, x, kernels):
    kernel = "cuequivariance" if kernels else "torch"
    return model(x["s"], x["z"], x["pair_mask"], triangle_multiplicative=kernel,
                 triangle_attention=kernel)


CLIENTS = {
    "openfold3": Client(
        name="openfold3", integration="openfold3", batched=True,
        # openfold3 0.5.0's model_config "pairformer" (48 blocks there).
        defaults=dict(c_s=384, c_z=128, c_hidden_pair_bias=24, no_heads_pair_bias=16,
                      c_hidden_mul=128, c_hidden_pair_att=32, no_heads_pair=4, no_blocks=4,
                      transition_type="swiglu", transition_n=4, pair_dropout=0.25,
                      fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9),
        # Its cuEquivariance trimul call site takes pair widths that are multiples of 32 only.
        small=dict(c_s=24, c_z=32, c_hidden_pair_bias=6, no_heads_pair_bias=4, c_hidden_mul=32,
                   c_hidden_pair_att=8, no_heads_pair=2, no_blocks=2, transition_type="swiglu",
                   transition_n=2, pair_dropout=0.0, fuse_projection_weights=False,
                   blocks_per_ckpt=None, inf=1e9),
        build=_openfold3_build, forward=_openfold3_forward),
    "boltz": Client(
        name="boltz", integration="boltz", batched=True,
        # Boltz-2's trunk: PairformerModule(token_s=384, token_z=128, v2=True), 64 blocks there.
        defaults=dict(token_s=384, token_z=128, num_blocks=4, num_heads=16, dropout=0.25,
                      pairwise_head_width=32, pairwise_num_heads=4, v2=True),
        small=dict(token_s=24, token_z=16, num_blocks=2, num_heads=4, dropout=0.0,
                   pairwise_head_width=8, pairwise_num_heads=2, v2=True),
        build=_boltz_build, forward=_boltz_forward),
    "protenix": Client(
        name="protenix", integration="protenix", batched=False,
        # protenix 2.0.0's PairformerStack defaults (48 blocks there).
        defaults=dict(n_blocks=4, n_heads=16, c_z=128, c_s=384, num_intermediate_factor=4,
                      dropout=0.25),
        # hidden_scale_up makes the trimul's hidden width the pair width (Protenix's kernel path
        # needs them equal) and the triangle heads c_z / 32 of head dim 32.
        small=dict(n_blocks=2, n_heads=4, c_z=64, c_s=24, num_intermediate_factor=2, dropout=0.0,
                   hidden_scale_up=True),
        build=_protenix_build, forward=_protenix_forward),
}


def widths(client: Client, config: dict) -> tuple[int, int]:
    """(c_s, c_z) of a configuration."""
    if client.name == "boltz":
        return config["token_s"], config["token_z"]
    return config["c_s"], config["c_z"]


def with_dropout(client: Client, config: dict, rate: float) -> dict:
    key = {"openfold3": "pair_dropout", "boltz": "dropout", "protenix": "dropout"}[client.name]
    return {**config, key: rate}
