"""Audio input of an encoder-decoder: the encoder reads log-mel features, not token ids.

`TransformerConfig.audio` is None (the encoder reads tokens) or an `AudioInput`; with one,
the encoder's input is float features [B, M, F] (M mel bins, F = 2 * max_source_positions
frames) and its embedding is `AudioEmbedding`, Whisper's convolutional front end:

    features [B, M, F] -> conv1d(M -> D, kernel 3, padding 1) -> GELU (erf)
                       -> conv1d(D -> D, kernel 3, stride 2, padding 1) -> GELU (erf)
                       -> [B, S = F / 2, D] + fixed sinusoids [S, D] -> dropout

The encoder then runs its layers over all S frames: no source padding mask, as Whisper's
encoder attends to every frame of its 30 s window (transformers ignores an attention mask
there too). Features are computed outside the model (`models.audio_features`). Everything
after the encoder (the cross-attention keys/values, the cache, decoding) is the
encoder-decoder's token path unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from models.axes import ZEROS, named, normal_init
from models.errors import UserError, check_positive_int


@dataclasses.dataclass(frozen=True)
class AudioInput:
    """The encoder's audio input (`TransformerConfig.audio`).

    Attributes:
        num_mel_bins: M, the mel bins of each frame (80, or 128 for Whisper large-v3).
        max_source_positions: S, the encoder's positions: its input has 2 * S frames
            (Whisper: 1500 positions, 3000 frames of 10 ms, 30 s).
    """

    num_mel_bins: int = 80
    max_source_positions: int = 1500

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = check_positive_int(getattr(self, field.name), f"audio.{field.name}")
            object.__setattr__(self, field.name, value)

    @property
    def num_frames(self) -> int:
        """F = 2 * S: the frames of the input features (the second convolution halves it)."""
        return 2 * self.max_source_positions

    @classmethod
    def of(cls, value) -> AudioInput | None:
        """None, an `AudioInput`, or one from a dict of its fields (unknown keys named)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise UserError(f"TransformerConfig.audio has unknown field(s) {unknown}; "
                                f"known: {sorted(known)}")
            return cls(**value)
        raise UserError(f"TransformerConfig.audio={value!r} must be an AudioInput or a dict "
                        "of its fields")


@functools.lru_cache(maxsize=8)
def whisper_sinusoids(length: int, channels: int) -> np.ndarray:
    """float32[length, channels]: Whisper's fixed encoder positions, sines in the first
    half of the channels and cosines in the second, frequencies
    exp(-i * log(10000) / (channels / 2 - 1)). The angles are float32 products, as
    Whisper computes them; sine and cosine are taken in float64 and rounded once.

        channels = 4, position p:  [sin(p), sin(p / 10000), cos(p), cos(p / 10000)]
    """
    half = channels // 2
    increment = np.log(10_000.0) / (half - 1)
    inv = np.exp((-increment * np.arange(half)).astype(np.float32)).astype(np.float32)
    angle = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]        # float32
    angle = angle.astype(np.float64)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)


def check_features(audio: AudioInput, features) -> None:
    """features must be a float array [B, num_mel_bins, num_frames]."""
    shape = getattr(features, "shape", None)
    dtype = getattr(features, "dtype", None)
    if shape is None or len(shape) != 3 or not jnp.issubdtype(dtype, jnp.floating):
        raise UserError(f"audio features must be a float array [B, mel, frames], got "
                        f"{dtype} {shape} (an audio model reads log-mel features, "
                        "models.audio_features; decode.whisper.transcribe decodes them)")
    want = (audio.num_mel_bins, audio.num_frames)
    if tuple(shape[1:]) != want:
        raise UserError(
            f"audio features have shape {tuple(shape)}, but the model reads [B, "
            f"num_mel_bins={want[0]}, frames={want[1]}] (2 * max_source_positions; pad or "
            "trim audio to the model's window, as models.audio_features does)")


class AudioEmbedding(nn.Module):
    """Whisper's front end (see the module docstring): [B, M, F] -> [B, F / 2, D]. Its
    parameters are `conv1` and `conv2` (flax `Conv` kernels [3, in, out] and biases)."""

    config: object            # TransformerConfig with `audio` set

    @nn.compact
    def __call__(self, features_BMF: Float[Array, "B M F"],
                 deterministic: bool) -> Float[Array, "B S D"]:
        cfg = self.config
        check_features(cfg.audio, features_BMF)

        def conv(name, stride):
            return nn.Conv(cfg.d_model, kernel_size=(3,), strides=(stride,), padding=((1, 1),),
                           dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                           kernel_init=named(normal_init(0.02), "taps", "conv_in", "embed"),
                           bias_init=named(ZEROS, "embed"), name=name)

        x_BFM = jnp.swapaxes(features_BMF, 1, 2).astype(cfg.dtype)
        x_BFD = nn.gelu(conv("conv1", 1)(x_BFM), approximate=False)
        x_BSD = nn.gelu(conv("conv2", 2)(x_BFD), approximate=False)
        table_SD = whisper_sinusoids(cfg.audio.max_source_positions, cfg.d_model)
        x_BSD = x_BSD + jnp.asarray(table_SD).astype(x_BSD.dtype)[None]
        return nn.Dropout(cfg.dropout_rate)(x_BSD, deterministic=deterministic)
