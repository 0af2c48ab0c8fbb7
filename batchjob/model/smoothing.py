"""SmoothQuant's scales for int8 matmuls (`engine.weights: w8a8`, matmul/int8_linear.py): a matmul's input channel k
divided by s_k and its weight column multiplied by s_k leaves the product as it was, y = (x / s) (W s)^T, and the
division folds into whatever writes x (a norm's weight, the rows of the matmul before), so it costs nothing at run
time. With s_k = max|x_k|^alpha / max|W[:, k]|^(1 - alpha) an outlier channel of the activations (SmolLM2 has a few
that are tens of times the rest) is scaled down and its weight column up: a row's per-token int8 step, set by its
largest value, no longer flattens every other channel to a few levels (Xiao et al., 2023, SmoothQuant).

max|x_k| comes from one pass of the float model over CALIBRATION_TEXT at load, as recorded by AbsMaxRecorder."""

from __future__ import annotations

import torch

ALPHA = 0.5  # how much of an outlier's range moves into the weights (SmoothQuant's migration strength)
_TINY = 1e-5  # the floor of a channel's max |x| and max |W|: a channel never seen nonzero keeps a finite scale

# A fixed text the float model runs once at load to measure each matmul input's channels: original prose, not from
# the sample data the benchmarks score, a few hundred tokens of narrative, explanation, dialogue and figures.
CALIBRATION_TEXT = """\
The harbour town woke slowly that winter. Fishing boats rocked against the quay while the baker, a tall woman named
Marguerite, swept flour from her doorstep and argued with the postman about the price of coal. "Eleven shillings a
sack," he said, "and not a penny less, whatever the mayor promised in October." She laughed and handed him a loaf.

A computer program is a list of instructions that a machine follows one after another. When a function is called,
its arguments are evaluated first; then the body runs with those values bound to the parameter names. If an error
occurs, the interpreter unwinds the stack until it finds a handler, or prints a traceback and stops. For example,
dividing 7 by 0 raises ZeroDivisionError, while int("42") returns the integer 42.

Summary of the quarterly report: revenue rose 12.5% to $4.3 million, driven mainly by exports to Canada and Japan.
Costs grew more slowly (up 6%), so the operating margin widened from 18% to 22%. The board recommends a dividend of
30 cents per share and plans to open two new warehouses, in Leeds and in Rotterdam, before the end of next year.

Dear Sir, I write to ask whether the committee has yet reached a decision on my application. I submitted the forms
on the third of March, together with two letters of reference, and I have heard nothing since. Yours faithfully.

Q: Why is the sky blue? A: Sunlight is scattered by the molecules of the air, and shorter wavelengths, which we see
as blue, are scattered much more strongly than longer ones such as red. At sunset the light crosses more air, so the
blue is scattered away and the sky near the horizon looks orange."""


class AbsMaxRecorder:
    """A matmul's stand-in during calibration: computes it, and keeps each input channel's largest magnitude."""

    def __init__(self, linear):
        self.linear = linear
        self.absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        self.absmax = seen if self.absmax is None else torch.maximum(self.absmax, seen)
        return self.linear(x)


def smoothing_scales(x_absmax: torch.Tensor, weight: torch.Tensor, alpha: float | None = None) -> torch.Tensor:
    """s [K] (fp32) for W [N, K] whose input channels reached x_absmax [K]: max|x_k|^alpha / max|W_k|^(1 - alpha),
    alpha ALPHA by default."""
    alpha = ALPHA if alpha is None else alpha
    w_absmax = weight.float().abs().amax(dim=0).clamp(min=_TINY)
    return x_absmax.float().clamp(min=_TINY).pow(alpha) / w_absmax.pow(1 - alpha)
