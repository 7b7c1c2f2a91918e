"""Comparison helpers with tolerances derived from the roundings of each path."""

import torch

# One bf16 rounding: half an ulp, i.e. 2^-9 relative; an ulp is 2^-8 relative at most 2^-7.
BF16_ULP = 2.0**-7


def tolerance(device: str, dtype: torch.dtype, grads: bool) -> tuple:
    """(rel, abs_frac): |a - b| <= rel * |ref| + abs_frac * max|ref| elementwise.

    - CPU f32: the oracle and torch sum in different orders: f32 noise only.
    - CPU bf16: both are f32 math rounded once to bf16: one bf16 ulp (the f32 order may put
      the two on either side of a rounding boundary).
    - CUDA bf16: the GPU layer also stores a, b, h, y (and in the backward [da|db], w*h,
      dlogits) in bf16 between kernels: 4 (forward) or 8 (backward) extra half-ulp roundings
      of terms up to max|ref|, so a bound in units of max|ref|.
    """
    if device == "cpu" and dtype == torch.float32:
        return (1e-4, 1e-5)
    if device == "cpu":
        return (BF16_ULP, 1e-5)
    return (BF16_ULP, (8 if grads else 4) * 2.0**-9)


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: tuple) -> None:
    """Elementwise bound; NaN or inf in `got` always fails."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    g, r = got.detach().float().cpu(), ref.detach().float().cpu()
    assert torch.isfinite(g).all(), f"{name}: non-finite values in afdep's result"
    assert torch.isfinite(r).all(), f"{name}: non-finite values in the reference"
    rel, frac = tol
    scale = r.abs().max().item() if r.numel() else 0.0
    bound = rel * r.abs() + frac * scale
    err = (g - r).abs()
    bad = err > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {g.numel()} elements out of tolerance; first at "
            f"flat index {i}: afdep {g.flatten()[i].item()!r}, reference "
            f"{r.flatten()[i].item()!r}, bound {bound.flatten()[i].item()!r} (max|ref| {scale})"
        )
