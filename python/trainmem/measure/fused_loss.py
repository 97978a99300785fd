"""`--loss fused`: a chunked linear + cross-entropy in plain torch, the reference the engine mirrors.

It behaves like Liger-Kernel's fused linear cross-entropy as far as memory goes: the b·s·V
logits never exist at once, and the gradients of the hidden states and of the lm_head weight
are computed in the forward, one chunk of rows at a time.

Note [Fused loss allocations]
    rows = b·s, V = vocab, h = hidden, cd = compute dtype (the autocast dtype under *-mixed,
    else the weight dtype), chunk = next_pow2(ceil(rows / ceil(V / h))) rows (Liger's rule).

    md = the math dtype: fp32 when cd is bf16/fp16, else cd.

    once, in the forward:
      w_cd    = weight.to(cd)                 V·h·|cd|  (only if the weight is not cd already;
                                                         a cast of a parameter under autocast:
                                                         category weights; freed at the end)
      grad_x  = empty(rows, h, cd)            rows·h·|cd|
      grad_w  = zeros(V, h, cd)               V·h·|cd|  (only if the weight requires grad: a
                                                         LoRA run's frozen lm_head has none, as
                                                         in Liger)
      valid (bool, rows), its count (int64 scalar) and n_valid (md scalar), loss_sum (md
      scalar), the targets clamped to ≥ 0 (int64, rows)
    per chunk of c rows (everything below is freed before the next chunk):
      xc      = x[rows].to(cd)                c·h·|cd|  (only if x is not cd)
      logits  = xc @ w_cd.T                   c·V·|cd|
      z       = logits.to(md)                 c·V·|md|  (only if cd is not md; logits freed)
      softcap (Gemma-2): t = tanh(z / cap)    c·V·|md|, z = cap·t in place
      targets and validity of the chunk, row max, target logit, row sums, log, the per-row
      loss and its sum: (c, 1)-sized, small
      z is turned into the gradient of the logits in place: exp, divide by the row sum,
      subtract 1 at the target, scale by valid / n_valid (softcap: times 1 - t², t freed)
      g       = z.to(cd)                      c·V·|cd|  (only if cd is not md; z freed)
      grad_x[rows] = g @ w_cd                 written in place (mm with out=)
      grad_w += g.T @ xc                      in place (addmm_; not with a frozen weight)
    end of the forward:
      grad_x -> hidden's dtype, grad_w -> the weight's dtype (a copy each if they differ; the
      cd buffers are freed), loss = loss_sum / n_valid.
      grad_x is saved with save_for_backward (category activations); grad_w is kept on ctx and
      handed to autograd in the backward, where it becomes the weight's .grad (gradients).
    backward: both are multiplied in place by the incoming scalar gradient (no allocation).
"""

from __future__ import annotations

import math

import torch

IGNORE_INDEX = -100


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Liger's chunk size: about as many logits per chunk as there are hidden-state elements."""
    inc_factor = math.ceil(vocab / hidden)
    size = math.ceil(rows / inc_factor)
    return 1 << max(0, (size - 1).bit_length())


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, compute_dtype, softcap):
        h = hidden.shape[-1]
        vocab = weight.shape[0]
        x = hidden.reshape(-1, h)
        t = targets.reshape(-1)
        rows = x.shape[0]
        step = chunk_rows(rows, vocab, h)
        w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
        grad_x = torch.empty((rows, h), dtype=compute_dtype, device=x.device)
        grad_w = torch.zeros((vocab, h), dtype=compute_dtype, device=x.device) if weight.requires_grad else None
        math_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
        valid = t != IGNORE_INDEX
        n_valid = valid.sum().clamp_(min=1).to(math_dtype)
        loss_sum = torch.zeros((), dtype=math_dtype, device=x.device)
        safe_t = t.clamp(min=0)
        for start in range(0, rows, step):
            end = min(rows, start + step)
            xc = x[start:end]
            if xc.dtype != compute_dtype:
                xc = xc.to(compute_dtype)
            logits = xc @ w.t()
            z = logits.to(math_dtype) if logits.dtype != math_dtype else logits
            del logits
            tanh = None
            if softcap:
                tanh = z.div(softcap).tanh_()
                torch.mul(tanh, softcap, out=z)
            tc = safe_t[start:end].unsqueeze(1)
            vc = valid[start:end].unsqueeze(1).to(math_dtype)
            row_max = z.amax(dim=1, keepdim=True)
            z.sub_(row_max)
            target = z.gather(1, tc)
            z.exp_()
            row_sum = z.sum(dim=1, keepdim=True)
            loss_sum.add_(((row_sum.log() - target) * vc).sum())
            z.div_(row_sum)
            z.scatter_add_(1, tc, vc.neg())
            z.mul_(vc / n_valid)
            if tanh is not None:
                z.mul_(tanh.mul_(tanh).neg_().add_(1))
                del tanh
            g = z.to(compute_dtype) if compute_dtype != math_dtype else z
            del z
            torch.mm(g, w, out=grad_x[start:end])
            if grad_w is not None:
                grad_w.addmm_(g.t(), xc)
            del g, xc
        del w
        if grad_x.dtype != hidden.dtype:
            grad_x = grad_x.to(hidden.dtype)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_x)
        ctx.grad_w = grad_w
        ctx.hidden_shape = hidden.shape
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_x,) = ctx.saved_tensors
        grad_w, ctx.grad_w = ctx.grad_w, None
        grad_x.mul_(grad_loss)
        if grad_w is not None:
            grad_w.mul_(grad_loss)
        return grad_x.view(ctx.hidden_shape), grad_w, None, None, None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """As Hugging Face's ForCausalLMLoss: pad by one ignore_index, drop the first column."""
    padded = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
    return padded[..., 1:].contiguous()


def fused_linear_cross_entropy(hidden, weight, labels, *, compute_dtype, softcap=None):
    with torch.autocast(hidden.device.type, enabled=False):
        targets = shift_labels(labels)
        return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, compute_dtype, softcap)
