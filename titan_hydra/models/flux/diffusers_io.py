"""Our FLUX.1 state dict <-> diffusers' ``FluxTransformer2DModel`` (names, fused tensors, chunk order).

Every tensor maps bit for bit; only three things besides names differ:

* fused columns: diffusers' single-block ``proj_out`` reads the concatenation [attention | MLP]; ours
  is two linears, ``attn_out`` (its first ``dim`` input columns, no bias) and ``mlp_out`` (the rest,
  with its bias), whose outputs are summed. Every q/k/v and MLP projection is its own tensor on
  both sides (BFL's original checkpoints fuse them; diffusers and we do not);
* the final adaLN: ours is ordered (shift, scale), diffusers' ``norm_out.linear`` (scale, shift),
  so its two row halves swap; the block modulations share the (shift, scale, gate) order;
* ``FluxTransformer2DModel`` hard-codes ``mlp_ratio`` 4, rope theta 10000, 256 timestep features
  and biases on every linear, so args that differ (e.g. ``qkv_bias=False``) cannot be converted.

The mapping is one table of pieces (``_layout``): each of our tensors is the concatenation of whole
diffusers tensors or row/column ranges of them; both directions read that table, so they are exact
inverses. Renamed tensors are passed through (no copy); pieces of fused tensors are concatenated
into new tensors, so no two outputs share storage (safetensors refuses that).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from titan_hydra.models.flux.model import PATCH, FluxArgs
from titan_hydra.models.protocol import HFAdapter

# One piece of one of our tensors: indices [start, stop) along dim (0: rows, 1: columns) of a diffusers tensor.
Piece = tuple[str, int, int, int]

# Keys of FluxTransformer2DModel's config that the published config.json files may omit, with the
# values its constructor then uses; shape keys (layers, widths, heads) are required.
OPTIONAL_KEYS: dict[str, Any] = {"patch_size": 1, "out_channels": None, "guidance_embeds": False,
                                 "axes_dims_rope": [16, 56, 56]}
SHAPE_KEYS = ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
              "joint_attention_dim", "pooled_projection_dim")
# What FluxTransformer2DModel fixes in code: our args must hold these values to be convertible.
FIXED = {"mlp_ratio": 4.0, "theta": 10000, "qkv_bias": True, "time_dim": 256}


def check_convertible(args: FluxArgs) -> None:
    """One-line ValueError if diffusers' FluxTransformer2DModel cannot hold a model of these args."""
    for name, value in FIXED.items():
        if getattr(args, name) != value:
            raise ValueError(f"model.{name}={getattr(args, name)!r}: diffusers' FluxTransformer2DModel "
                             f"fixes it to {value!r}, so this model cannot be converted")


def diffusers_config(args: FluxArgs) -> dict[str, Any]:
    """``FluxTransformer2DModel`` constructor kwargs of a model of these args."""
    check_convertible(args)
    return {"patch_size": 1, "in_channels": args.in_channels, "out_channels": None,
            "num_layers": args.n_double_blocks, "num_single_layers": args.n_single_blocks,
            "attention_head_dim": args.head_dim, "num_attention_heads": args.n_heads,
            "joint_attention_dim": args.context_dim, "pooled_projection_dim": args.pooled_dim,
            "guidance_embeds": args.guidance_embed, "axes_dims_rope": list(args.axes_dim)}


def args_from_diffusers_config(cfg: dict[str, Any]) -> FluxArgs:
    """FluxArgs of a ``FluxTransformer2DModel`` config (its config.json; ``_``-keys are metadata)."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    unknown = sorted(set(cfg) - set(OPTIONAL_KEYS) - set(SHAPE_KEYS))
    if unknown:
        raise ValueError(f"diffusers config keys {unknown} are not options of FLUX.1's FluxTransformer2DModel")
    missing = [k for k in SHAPE_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"diffusers config lacks the shape keys {missing}")
    cfg = {**OPTIONAL_KEYS, **cfg}
    if cfg["patch_size"] != 1:
        raise ValueError(f"diffusers config patch_size={cfg['patch_size']}: only 1 is supported (FLUX packs "
                         f"{PATCH}x{PATCH} patches outside the transformer)")
    if cfg["out_channels"] not in (None, cfg["in_channels"]):
        raise ValueError(f"diffusers config out_channels={cfg['out_channels']} differs from "
                         f"in_channels={cfg['in_channels']}: not a FLUX.1 velocity model")
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    return FluxArgs(dim=heads * head_dim, n_heads=heads, n_double_blocks=cfg["num_layers"],
                    n_single_blocks=cfg["num_single_layers"], context_dim=cfg["joint_attention_dim"],
                    pooled_dim=cfg["pooled_projection_dim"], in_channels=cfg["in_channels"],
                    axes_dim=list(cfg["axes_dims_rope"]), guidance_embed=bool(cfg["guidance_embeds"]))


def _linear(ours: str, *theirs: tuple[str, int]) -> dict[str, list[Piece]]:
    """Weight and bias entries of one of our linears: the diffusers linears ``(name, out_features)``
    stacked along the output rows (one of them: a rename)."""
    return {f"{ours}.{p}": [(f"{name}.{p}", 0, 0, n) for name, n in theirs] for p in ("weight", "bias")}


def _norm(ours: str, theirs: str, n: int) -> dict[str, list[Piece]]:
    return {f"{ours}.weight": [(f"{theirs}.weight", 0, 0, n)]}


def _layout(args: FluxArgs) -> dict[str, list[Piece]]:
    """Our key -> the diffusers pieces it stacks, for every parameter of a model of these args."""
    check_convertible(args)
    d, hd, m = args.dim, args.head_dim, args.mlp_hidden_dim
    emb = "time_text_embed"
    table = {
        **_linear("img_in", ("x_embedder", d)),
        **_linear("txt_in", ("context_embedder", d)),
        **_linear("time_in.in_layer", (f"{emb}.timestep_embedder.linear_1", d)),
        **_linear("time_in.out_layer", (f"{emb}.timestep_embedder.linear_2", d)),
        **_linear("vector_in.in_layer", (f"{emb}.text_embedder.linear_1", d)),
        **_linear("vector_in.out_layer", (f"{emb}.text_embedder.linear_2", d)),
        **_linear("final_layer.linear", ("proj_out", args.in_channels)),
        # ours (shift, scale) = diffusers' second half, then its first
        **{f"final_layer.mod.{p}": [(f"norm_out.linear.{p}", 0, d, 2 * d), (f"norm_out.linear.{p}", 0, 0, d)]
           for p in ("weight", "bias")},
    }
    if args.guidance_embed:
        table.update(_linear("guidance_in.in_layer", (f"{emb}.guidance_embedder.linear_1", d)))
        table.update(_linear("guidance_in.out_layer", (f"{emb}.guidance_embedder.linear_2", d)))
    for i in range(args.n_double_blocks):
        o, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        for ours, theirs, q, k, v, out, ff, qn, kn in (
                ("img", "norm1", "to_q", "to_k", "to_v", "to_out.0", "ff", "norm_q", "norm_k"),
                ("txt", "norm1_context", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context",
                 "norm_added_q", "norm_added_k")):
            table.update({
                **_linear(f"{o}.{ours}_mod", (f"{t}.{theirs}.linear", 6 * d)),
                **_linear(f"{o}.{ours}_attn.q", (f"{t}.attn.{q}", d)),
                **_linear(f"{o}.{ours}_attn.k", (f"{t}.attn.{k}", d)),
                **_linear(f"{o}.{ours}_attn.v", (f"{t}.attn.{v}", d)),
                **_norm(f"{o}.{ours}_attn.q_norm", f"{t}.attn.{qn}", hd),
                **_norm(f"{o}.{ours}_attn.k_norm", f"{t}.attn.{kn}", hd),
                **_linear(f"{o}.{ours}_attn.proj", (f"{t}.attn.{out}", d)),
                **_linear(f"{o}.{ours}_mlp.fc1", (f"{t}.{ff}.net.0.proj", m)),
                **_linear(f"{o}.{ours}_mlp.fc2", (f"{t}.{ff}.net.2", d)),
            })
    for i in range(args.n_single_blocks):
        o, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        table.update({
            **_linear(f"{o}.mod", (f"{t}.norm.linear", 3 * d)),
            **_linear(f"{o}.q", (f"{t}.attn.to_q", d)),
            **_linear(f"{o}.k", (f"{t}.attn.to_k", d)),
            **_linear(f"{o}.v", (f"{t}.attn.to_v", d)),
            **_linear(f"{o}.mlp_in", (f"{t}.proj_mlp", m)),
            **_norm(f"{o}.q_norm", f"{t}.attn.norm_q", hd),
            **_norm(f"{o}.k_norm", f"{t}.attn.norm_k", hd),
            f"{o}.attn_out.weight": [(f"{t}.proj_out.weight", 1, 0, d)],
            f"{o}.mlp_out.weight": [(f"{t}.proj_out.weight", 1, d, d + m)],
            f"{o}.mlp_out.bias": [(f"{t}.proj_out.bias", 0, 0, d)],
        })
    return table


def _extents(table: dict[str, list[Piece]]) -> dict[tuple[str, int], int]:
    """(diffusers key, dim) -> its size along dim that the table reads (the end of its last piece)."""
    sizes: dict[tuple[str, int], int] = {}
    for pieces in table.values():
        for key, dim, _, stop in pieces:
            sizes[key, dim] = max(sizes.get((key, dim), 0), stop)
    return sizes


def _check(sd: dict[str, torch.Tensor], sizes: dict[tuple[str, int], int], side: str) -> None:
    """One-line ValueError unless ``sd`` holds exactly these keys with these sizes along these dims."""
    keys = {key for key, _ in sizes}
    missing, unexpected = sorted(keys - set(sd)), sorted(set(sd) - keys)
    if missing or unexpected:
        raise ValueError(f"{side} state dict does not match the args: missing {missing[:4]} ({len(missing)}), "
                         f"unexpected {unexpected[:4]} ({len(unexpected)})")
    wrong = [f"{k} {tuple(sd[k].shape)}" for (k, dim), n in sizes.items() if sd[k].dim() <= dim or sd[k].shape[dim] != n]
    if wrong:
        raise ValueError(f"{side} state dict tensors of the wrong size for the args: {wrong[:4]} ({len(wrong)})")


def _is_rename(pieces: list[Piece], sizes: dict[tuple[str, int], int]) -> bool:
    """One piece that is a whole diffusers tensor."""
    key, dim, start, stop = pieces[0]
    return len(pieces) == 1 and start == 0 and stop == sizes[key, dim]


def from_diffusers_state(sd: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
    """``FluxTransformer2DModel.state_dict()`` -> our state dict (same values, bit for bit)."""
    table = _layout(args)
    sizes = _extents(table)
    _check(sd, sizes, "diffusers")
    out = {}
    for ours, pieces in table.items():
        if _is_rename(pieces, sizes):
            out[ours] = sd[pieces[0][0]]
        else:
            out[ours] = torch.cat([sd[k].narrow(dim, a, b - a) for k, dim, a, b in pieces], dim=pieces[0][1])
    return out


def to_diffusers_state(sd: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> ``FluxTransformer2DModel.state_dict()`` layout (same values, bit for bit)."""
    table = _layout(args)
    _check(sd, {(ours, pieces[0][1]): sum(b - a for _, _, a, b in pieces) for ours, pieces in table.items()}, "our")
    sizes = _extents(table)
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # fused key -> [(dim, its first index, our slice)]
    for ours, pieces in table.items():
        if _is_rename(pieces, sizes):
            out[pieces[0][0]] = sd[ours]
            continue
        offset = 0
        for key, dim, start, stop in pieces:
            parts.setdefault(key, []).append((dim, start, sd[ours].narrow(dim, offset, stop - start)))
            offset += stop - start
    for key, got in parts.items():  # cat copies, so no output shares storage with a fused tensor of ours
        out[key] = torch.cat([t for _, _, t in sorted(got, key=lambda p: p[1])], dim=got[0][0])
    return out


class FluxDiffusersAdapter(HFAdapter):
    """The family's Hugging Face counterpart: a diffusers ``FluxTransformer2DModel`` directory
    (``config.json`` + ``diffusion_pytorch_model.safetensors``), which
    ``FluxTransformer2DModel.from_pretrained`` loads and ``recipes/convert.py`` reads and writes."""

    model_type = "FluxTransformer2DModel"
    weights_file = "diffusion_pytorch_model.safetensors"

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
        return to_diffusers_state(sd, args)

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: FluxArgs) -> dict[str, torch.Tensor]:
        return from_diffusers_state(sd, args)

    def hf_config(self, args: FluxArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        try:
            made_for = version("diffusers")
        except PackageNotFoundError:
            made_for = "0.42.1"
        return {"_class_name": self.model_type, "_diffusers_version": made_for, **diffusers_config(args)}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> FluxArgs:
        return args_from_diffusers_config(cfg)
