"""The client packages' own PairFormer stacks (OpenFold3, Boltz, Protenix), built and run on each
of three paths: the client's PyTorch code ("pytorch"), its cuEquivariance path ("cuequivariance",
the client's kernel switch on) and ours ("ours", tpfkit.integrations enabled). Shared by
clients_gpu.py (bench/clients.py) and the integration tests.

A client's `build(**config)` takes its PairFormer's own argument names; DEFAULTS are its default
configuration (AlphaFold3's widths), blocks aside. `inputs(N, ...)` makes s, z and masks with the
last tokens padded, in the layout the client's stack takes; `run(model, inputs, path)` is one
forward on that path and returns (s, z).

The modules of its pair stack alone (MODULES: the triangle attention from the starting and the
ending node, the outgoing triangle multiplicative update, the pair transition): `module(kind, c_z, config)` builds one with the stack's own
classes and arguments, `run_module(kind, module, z, pair_mask, path)` is one forward of it as the
client's pair stack calls it (the ending node's transposes included) and returns its update of z.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch

PATHS = ("pytorch", "cuequivariance", "ours")
MODULES = ("tri_att_start", "tri_att_end", "tri_mul_out", "pair_transition")


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    integration: str                      # tpfkit.integrations.<integration>
    defaults: dict                        # its PairFormer's default configuration
    small: dict                           # a small one for CPU tests
    batched: bool                         # whether its stack takes a batch dimension
    build: Callable[..., torch.nn.Module]
    forward: Callable[..., tuple]         # forward(model, inputs, kernels: bool) -> (s, z)
    # build_module(kind, c_z, config) -> a module of its pair stack (MODULES), config its stack's;
    # forward_module(kind, module, z, pair_mask, kernels) -> its update of z
    build_module: Callable[..., torch.nn.Module] = None
    forward_module: Callable[..., torch.Tensor] = None

    def integration_module(self):
        return importlib.import_module(f"tpfkit.integrations.{self.integration}")

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

    def module(self, kind: str, config: dict) -> torch.nn.Module:
        """One module of the pair stack of `config` (MODULES), built as the stack builds it."""
        if kind not in MODULES:
            raise ValueError(f"kind must be one of {MODULES}, got {kind!r}")
        return self.build_module(kind, widths(self, config)[1], config)

    def run_module(self, kind: str, module: torch.nn.Module, z: torch.Tensor,
                   pair_mask: torch.Tensor, path: str) -> torch.Tensor:
        """One forward of a pair-stack module on a path, as the client's stack calls it (ours:
        with the kernel switch on, as the integration sets it in the stack)."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        integration = self.integration_module()
        with (integration.enabled() if path == "ours" else integration.disabled()):
            return self.forward_module(kind, module, z, pair_mask, kernels=path != "pytorch")

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


def _openfold3_module(kind, c_z, config):
    from openfold3.core.model.latent.base_blocks import PairBlock
    # The stack's own PairBlock builds the modules with its arguments and initializations.
    block = PairBlock(c_z=c_z, c_hidden_mul=config["c_hidden_mul"],
                      c_hidden_pair_att=config["c_hidden_pair_att"],
                      no_heads_pair=config["no_heads_pair"],
                      transition_type=config["transition_type"],
                      transition_n=config["transition_n"], pair_dropout=0.0,
                      fuse_projection_weights=config["fuse_projection_weights"], inf=config["inf"])
    return getattr(block, kind)


def _openfold3_module_forward(kind, module, z, pair_mask, kernels):
    if kind == "pair_transition":
        return module(z, mask=pair_mask)
    if kind == "tri_att_start":
        return module(z, mask=pair_mask, use_cueq_triangle_kernels=kernels)
    if kind == "tri_mul_out":  # as PairBlock.tri_mul_out_in calls it (not in place)
        return module(z, mask=pair_mask, inplace_safe=False, _add_with_inplace=False,
                      use_cueq_triangle_kernels=kernels)
    # PairBlock.tri_att_start_end: the ending node on z transposed, with transpose_bias.
    out = module(z.transpose(-2, -3), mask=pair_mask.transpose(-1, -2), transpose_bias=True,
                 use_cueq_triangle_kernels=kernels)
    return out.transpose(-2, -3)


def _boltz_build(**config: Any) -> torch.nn.Module:
    from boltz.model.layers.pairformer import PairformerModule
    return PairformerModule(**config)


def _boltz_forward(model, x, kernels):
    return model(x["s"], x["z"], x["token_mask"], x["pair_mask"], use_kernels=kernels)


def _boltz_module(kind, c_z, config):
    # A one-block stack builds its layer as the stack does (boltz-community's layer takes other
    # arguments).
    layer = _boltz_build(**{**config, "num_blocks": 1, "dropout": 0.0}).layers[0]
    return layer.transition_z if kind == "pair_transition" else getattr(layer, kind)


def _boltz_module_forward(kind, module, z, pair_mask, kernels):
    if kind == "pair_transition":
        return module(z)
    # PairformerLayer: the triangle modules take the same switch (tri_mul_out's use_cuequiv_mul
    # or use_kernels).
    return module(z, mask=pair_mask, use_kernels=kernels)


def _protenix_build(**config: Any) -> torch.nn.Module:
    from protenix.model.modules.pairformer import PairformerStack
    return PairformerStack(**config)


def _protenix_forward(model, x, kernels):
    kernel = "cuequivariance" if kernels else "torch"
    return model(x["s"], x["z"], x["pair_mask"], triangle_multiplicative=kernel,
                 triangle_attention=kernel)


def _protenix_module(kind, c_z, config):
    from protenix.model.modules.pairformer import PairformerBlock
    block = PairformerBlock(n_heads=config["n_heads"], c_z=c_z, c_s=0,
                            num_intermediate_factor=config["num_intermediate_factor"],
                            dropout=0.0, hidden_scale_up=config.get("hidden_scale_up", False))
    return getattr(block, kind)


def _protenix_module_forward(kind, module, z, pair_mask, kernels):
    if kind == "pair_transition":
        return module(z)
    kernel = "cuequivariance" if kernels else "torch"
    if kind == "tri_att_start":
        return module(z, mask=pair_mask, triangle_attention=kernel)
    if kind == "tri_mul_out":  # as PairformerBlock calls it in training (not in place)
        return module(z, mask=pair_mask, inplace_safe=False, _add_with_inplace=False,
                      triangle_multiplicative=kernel)
    # PairformerBlock: the ending node (a starting-node module) on z transposed.
    out = module(z.transpose(-2, -3).contiguous(), mask=pair_mask.transpose(-1, -2),
                 triangle_attention=kernel)
    return out.transpose(-2, -3)


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
        build=_openfold3_build, forward=_openfold3_forward, build_module=_openfold3_module,
        forward_module=_openfold3_module_forward),
    "boltz": Client(
        name="boltz", integration="boltz", batched=True,
        # Boltz-2's trunk: PairformerModule(token_s=384, token_z=128, v2=True), 64 blocks there.
        defaults=dict(token_s=384, token_z=128, num_blocks=4, num_heads=16, dropout=0.25,
                      pairwise_head_width=32, pairwise_num_heads=4, v2=True),
        small=dict(token_s=24, token_z=16, num_blocks=2, num_heads=4, dropout=0.0,
                   pairwise_head_width=8, pairwise_num_heads=2, v2=True),
        build=_boltz_build, forward=_boltz_forward, build_module=_boltz_module,
        forward_module=_boltz_module_forward),
    "protenix": Client(
        name="protenix", integration="protenix", batched=False,
        # protenix 2.0.0's PairformerStack defaults (48 blocks there).
        defaults=dict(n_blocks=4, n_heads=16, c_z=128, c_s=384, num_intermediate_factor=4,
                      dropout=0.25),
        # hidden_scale_up makes the trimul's hidden width the pair width (Protenix's kernel path
        # needs them equal) and the triangle heads c_z / 32 of head dim 32.
        small=dict(n_blocks=2, n_heads=4, c_z=64, c_s=24, num_intermediate_factor=2, dropout=0.0,
                   hidden_scale_up=True),
        build=_protenix_build, forward=_protenix_forward, build_module=_protenix_module,
        forward_module=_protenix_module_forward),
}


def widths(client: Client, config: dict) -> tuple[int, int]:
    """(c_s, c_z) of a configuration."""
    if client.name == "boltz":
        return config["token_s"], config["token_z"]
    return config["c_s"], config["c_z"]


def with_dropout(client: Client, config: dict, rate: float) -> dict:
    key = {"openfold3": "pair_dropout", "boltz": "dropout", "protenix": "dropout"}[client.name]
    return {**config, key: rate}
