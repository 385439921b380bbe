"""FLUX.1's frozen encoders: T5 (per-token context), CLIP text (pooled vector), the autoencoder.

All three come from the reference libraries, not from this repository: transformers'
``T5EncoderModel`` and ``CLIPTextModel``, diffusers' ``AutoencoderKL``. They are frozen (FLUX
trains only the transformer), so there is nothing to parallelize or convert, and the reference
implementation is the one whose numbers a user compares with; writing our own would only add a
place for them to differ.

``FluxEncoders.pretrained(dir)`` loads a local FLUX.1 directory in the diffusers layout
(``text_encoder/`` CLIP, ``text_encoder_2/`` T5, ``tokenizer/``, ``tokenizer_2/``, ``vae/``);
``FluxEncoders.tiny(...)`` builds small random ones from configs (tests and the debug flavor:
no download), reading captions as UTF-8 bytes (``ByteTokenizer``) or as words (``WordTokenizer``),
since no tokenizer file ships with random weights. A random ``AutoencoderKL`` decodes noise whatever the transformer learned, so
the tiny set's default autoencoder is ``DCTAutoencoder``: fixed, not learned, and its decoded
samples show colour and coarse shape, which is what the built-in shapes captions describe.
"""

from __future__ import annotations

from pathlib import Path

import zlib

import torch
import torch.nn.functional as F

from titan_hydra.quiet import import_quietly

# FLUX.1's autoencoder normalizes latents with these (diffusers' AutoencoderKL config of FLUX.1).
LATENT_CHANNELS = 16
LATENT_SCALE = 0.3611
LATENT_SHIFT = 0.1159
VAE_DOWNSAMPLE = 8



def quiet_autoencoder_kl() -> type:
    """diffusers' ``AutoencoderKL``, imported without the lines torchao and diffusers' torchao
    quantizer print while loading (CUDA kernels missing from a CPU install, deprecation notes);
    transformers' T5/CLIP imports then find torchao loaded and say nothing either."""
    import_quietly("torchao")
    dlog = import_quietly("diffusers.utils.logging")
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        return import_quietly("diffusers.models.autoencoders.autoencoder_kl").AutoencoderKL
    finally:
        dlog.set_verbosity(level)

class KLAutoencoder:
    """diffusers' ``AutoencoderKL`` with FLUX.1's latent normalization ((z - shift) * scale)."""

    def __init__(self, vae):
        self.vae = vae.eval().requires_grad_(False)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return (self.vae.encode(pixels).latent_dist.mode() - LATENT_SHIFT) * LATENT_SCALE

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents / LATENT_SCALE + LATENT_SHIFT).sample


class DCTAutoencoder:
    """A fixed linear autoencoder with FLUX.1's latent shape: each 8x8 RGB patch becomes 16
    orthonormal 2-D DCT coefficients (per colour channel the mean and the lowest frequencies:
    (0,0), (0,1), (1,0), (1,1), (0,2); (2,0) for green too), decoded by the transpose, i.e. the
    patch's projection onto those frequencies. ``SCALE`` brings the coefficients to about unit size."""

    SCALE = 0.25
    FREQUENCIES = [(c, f) for c in range(3) for f in ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2))] + [(1, (2, 0))]

    def __init__(self):
        n = torch.arange(VAE_DOWNSAMPLE, dtype=torch.float64)
        k = n[:, None]
        dct = torch.cos(torch.pi * (2 * n[None, :] + 1) * k / (2 * VAE_DOWNSAMPLE))  # [freq, pixel]
        dct[0] *= (1 / VAE_DOWNSAMPLE) ** 0.5
        dct[1:] *= (2 / VAE_DOWNSAMPLE) ** 0.5
        basis = torch.zeros(len(self.FREQUENCIES), 3, VAE_DOWNSAMPLE, VAE_DOWNSAMPLE, dtype=torch.float64)
        for row, (channel, (fy, fx)) in enumerate(self.FREQUENCIES):
            basis[row, channel] = dct[fy][:, None] * dct[fx][None, :]
        self.basis = basis.reshape(len(self.FREQUENCIES), -1).float()  # [16, 192], orthonormal rows

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixels.shape
        patches = F.unfold(pixels, VAE_DOWNSAMPLE, stride=VAE_DOWNSAMPLE)  # [N, 192, h/8 * w/8]
        coefficients = self.basis @ patches
        return (coefficients * self.SCALE).reshape(n, LATENT_CHANNELS, h // VAE_DOWNSAMPLE, w // VAE_DOWNSAMPLE)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        n, _, h, w = latents.shape
        patches = self.basis.T @ (latents.reshape(n, LATENT_CHANNELS, h * w) / self.SCALE)
        return F.fold(patches, (h * VAE_DOWNSAMPLE, w * VAE_DOWNSAMPLE), VAE_DOWNSAMPLE, stride=VAE_DOWNSAMPLE)


class ByteTokenizer:
    """Captions as UTF-8 bytes: ids 2..257 for bytes, 0 padding, 1 end of text."""

    pad_id, eos_id, vocab_size = 0, 1, 258

    def __call__(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(texts), max_len, dtype=torch.long)
        mask = torch.zeros(len(texts), max_len, dtype=torch.long)
        for i, text in enumerate(texts):
            row = [b + 2 for b in text.encode("utf-8")][: max_len - 1] + [self.eos_id]
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids, mask


class WordTokenizer(ByteTokenizer):
    """Captions as whitespace-separated words, each hashed (CRC-32) to one of 4,094 ids (2..4095;
    0 padding, 1 end of text). A word is one token, so a caption is about a fifth as many tokens
    as its bytes (the debug recipe's text is most of its sequence) and a colour name is one token
    whatever its length; no vocabulary file, so any text is read."""

    vocab_size = 4096

    def __call__(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(texts), max_len, dtype=torch.long)
        mask = torch.zeros(len(texts), max_len, dtype=torch.long)
        for i, text in enumerate(texts):
            row = [2 + zlib.crc32(w.encode("utf-8")) % (self.vocab_size - 2) for w in text.lower().split()]
            row = row[: max_len - 1] + [self.eos_id]
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids, mask


TOKENIZERS = {"bytes": ByteTokenizer, "words": WordTokenizer}


class FluxEncoders:
    """The three frozen encoders and the tokenizers they read; ``encode_text`` and
    ``encode_images`` are what the example builder calls."""

    def __init__(self, t5, clip, autoencoder, t5_tokenizer, clip_tokenizer, identity: str):
        self.t5, self.clip, self.autoencoder = t5.eval(), clip.eval(), autoencoder
        for module in (self.t5, self.clip):
            module.requires_grad_(False)
        self.t5_tokenizer, self.clip_tokenizer = t5_tokenizer, clip_tokenizer
        self.identity = identity  # what the cache key records

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def tiny(cls, context_dim: int, pooled_dim: int, seed: int = 0, autoencoder: str = "dct",
             tokens: str = "bytes") -> "FluxEncoders":
        """Small random text encoders of the right widths (T5 ``context_dim``, CLIP ``pooled_dim``)
        reading ``tokens`` (``bytes`` or ``words``: ``TOKENIZERS``), and ``autoencoder``: ``dct``
        (fixed, see DCTAutoencoder) or ``kl`` (a small random AutoencoderKL: the real
        architecture, for tests of that path)."""
        if autoencoder not in ("dct", "kl"):
            raise ValueError(f"data.examples.autoencoder={autoencoder!r} must be dct or kl")
        if tokens not in TOKENIZERS:
            raise ValueError(f"data.examples.tokenizer={tokens!r} must be one of {', '.join(TOKENIZERS)}")
        AutoencoderKL = quiet_autoencoder_kl()
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        tok = TOKENIZERS[tokens]()
        torch.manual_seed(seed)
        t5 = T5EncoderModel(T5Config(vocab_size=tok.vocab_size, d_model=context_dim, d_kv=8, d_ff=2 * context_dim,
                                     num_layers=2, num_heads=4, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id))
        clip_heads = 4 if pooled_dim % 4 == 0 else 1
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=tok.vocab_size, hidden_size=pooled_dim,
                                            intermediate_size=2 * pooled_dim, num_hidden_layers=2,
                                            num_attention_heads=clip_heads, max_position_embeddings=512,
                                            pad_token_id=tok.pad_id, bos_token_id=tok.eos_id,
                                            eos_token_id=tok.eos_id))
        if autoencoder == "kl":
            ae = KLAutoencoder(AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
                scaling_factor=LATENT_SCALE, shift_factor=LATENT_SHIFT))
        else:
            ae = DCTAutoencoder()
        words = "" if tokens == "bytes" else f":{tokens}"  # the byte encoders' identity as before
        return cls(t5, clip, ae, tok, tok, identity=f"tiny:{context_dim}:{pooled_dim}:{seed}:{autoencoder}{words}")

    @classmethod
    def pretrained(cls, directory: str) -> "FluxEncoders":
        """A local FLUX.1 checkpoint directory in the diffusers layout."""
        AutoencoderKL = quiet_autoencoder_kl()
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        root = Path(directory).expanduser()
        missing = [d for d in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae")
                   if not (root / d).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"{root} is not a FLUX.1 directory in the diffusers layout: no {', '.join(missing)}/")
        return cls(T5EncoderModel.from_pretrained(root / "text_encoder_2"),
                   CLIPTextModel.from_pretrained(root / "text_encoder"),
                   KLAutoencoder(AutoencoderKL.from_pretrained(root / "vae")),
                   _HFTokenizer(AutoTokenizer.from_pretrained(root / "tokenizer_2")),
                   _HFTokenizer(AutoTokenizer.from_pretrained(root / "tokenizer")),
                   identity=f"pretrained:{root.resolve()}")

    # -- encoding -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, captions: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 context [N, max_len, context_dim], CLIP pooled [N, pooled_dim]), fp32."""
        ids, mask = self.t5_tokenizer(captions, max_len)
        context = self.t5(input_ids=ids, attention_mask=mask).last_hidden_state
        clip_ids, _ = self.clip_tokenizer(captions, min(77, max_len))
        pooled = self.clip(input_ids=clip_ids).pooler_output
        return context.float(), pooled.float()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> normalized latents [N, 16, H/8, W/8] (the distribution's mode)."""
        pixels = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        return self.autoencoder.encode(pixels).float()

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [N, 16, h, w] -> uint8 images [N, 8h, 8w, 3]."""
        pixels = self.autoencoder.decode(latents)
        return ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)


class _HFTokenizer:
    """A transformers tokenizer behind ByteTokenizer's call signature."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.tokenizer(texts, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt")
        return out["input_ids"], out["attention_mask"]
