"In flight the half tensors are casts inside autograd: whatever a backward reaches is the model's own params, as in fp32"
import copy, warnings, torch, torch.nn as nn, pytest
from torch.utils.checkpoint import checkpoint
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.callback.core import Callback
from fastai_fp16.all import *
from helpers import *

def fit(model, dtype, cbs=(), epochs=2, lr=1e-2, opt_func=SGD, loss_func=None, dls=None, **kw):
    "`model` trained in fp32 (`dtype` None) or `to_half(dtype)` with a static scale (no skipped step); the Learner"
    learn = Learner(dls or synth_dls(n=64, bs=16), model, loss_func=loss_func or nn.MSELoss(), opt_func=opt_func, cbs=list(cbs), **kw)
    if dtype: learn.to_half(dtype, init_scale=256. if dtype == 'fp16' else 1., dynamic=False)
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, lr)
    return learn

dtypes = pytest.mark.parametrize('dtype', ['fp16', 'bf16'])

class Ckpt(nn.Module):
    "A block recomputed in the backward (`torch.utils.checkpoint`), as memory-limited training runs it"
    def __init__(self, reentrant):
        super().__init__(); self.body, self.head, self.reentrant = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 2), reentrant
    def forward(self, x):
        x = x.requires_grad_() if self.reentrant else x  # reentrant checkpointing needs an input that requires grad
        return self.head(checkpoint(self.body, x, use_reentrant=self.reentrant))

@dtypes
@pytest.mark.parametrize('reentrant', [False, True])
def test_gradient_checkpointing_trains_as_fp32(dtype, reentrant):
    torch.manual_seed(0); m = Ckpt(reentrant); w0 = [p.detach().clone() for p in m.parameters()]
    ref = fit(copy.deepcopy(m), None)
    learn = fit(m, dtype)  # "mat1 and mat2 must have the same dtype" before: the recomputation met the fp32 params
    moved_alike(params(learn), params(ref), w0)
    assert fp32_everywhere(learn)

class Mask(Callback):
    "Pruned training: a grad mask on the first layer's weight through a param hook, and a post-accumulate hook's count"
    def before_fit(self):
        w = self.model[0].weight
        self.mask = torch.rand_like(w) > 0.5
        self.w0, self.count = w.detach().clone(), 0
        self.hs = [w.register_hook(lambda g: g * self.mask), w.register_post_accumulate_grad_hook(self._count)]
    def _count(self, p): self.count += 1; self.dtype = p.grad.dtype
    def after_fit(self):
        for h in self.hs: h.remove()

@dtypes
def test_param_hooks_fire_as_in_fp32(dtype):
    a, b = Mask(), Mask()
    fit(tiny_model(), None, [a]); learn = fit(tiny_model(), dtype, [b])
    w = learn.model[0].weight.detach()
    assert torch.equal(w[~b.mask], b.w0[~b.mask]) and not torch.equal(w[b.mask], b.w0[b.mask])  # masked weights did not move
    assert b.count == a.count == 6 and b.dtype == torch.float32  # once a step, on the fp32 param (0 before)

class L2(Callback):
    "An L2 penalty added to the params' grads before the backward, in the loss scale's units (as with torch's GradScaler)"
    def __init__(self, wd): self.wd = wd
    def before_backward(self):
        s = self.learn.mixed_precision.loss_scale if hasattr(self.learn, 'mixed_precision') else 1.
        for p in self.model.parameters():
            g = self.wd * s * p.detach()
            p.grad = g if p.grad is None else p.grad + g

class Penalized(nn.Module):
    "A loss that holds the model's params and adds a penalty on them"
    def __init__(self, ps, wd): super().__init__(); self.ps, self.wd = ps, wd
    def forward(self, pred, y): return nn.functional.mse_loss(pred, y) + self.wd * sum((p.float()**2).sum() for p in self.ps())

@dtypes
def test_grads_a_user_adds_stay(dtype):
    w0 = params(Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()))
    plain, ref, ours = fit(tiny_model(), None), fit(tiny_model(), None, [L2(2.)]), fit(tiny_model(), dtype, [L2(2.)])
    moved_alike(params(ours), params(ref), w0, 0.05)
    assert torch.linalg.vector_norm(params(ours)[0] - params(plain)[0]) > 0.01  # the penalty acted (no effect before)
    r32, rh = tiny_model(), tiny_model()
    a = fit(r32, None, loss_func=Penalized(r32.parameters, 0.5)); b = fit(rh, dtype, loss_func=Penalized(rh.parameters, 0.5))
    moved_alike(params(b), params(a), w0, 0.05)
    assert torch.linalg.vector_norm(params(b)[0] - params(plain)[0]) > 0.01

class TaskWeights(nn.Module):
    "A multi-task loss with learnable weights of its own, stepped through the splitter"
    def __init__(self): super().__init__(); self.w = nn.Parameter(torch.tensor([1., 2.]))
    def forward(self, pred, y): return ((pred - y)**2).mean(0).mul(self.w).sum()

@dtypes
def test_a_losss_own_params_are_unscaled_and_checked(dtype):
    def run(d, poison=False):
        lf = TaskWeights()
        cbs = [Poison()] if poison else []
        learn = fit(tiny_model(), d, cbs, lr=1e-3, loss_func=lf, splitter=lambda m: [list(m.parameters()), list(lf.parameters())])
        return learn, lf.w.detach().clone()
    (_, w32), (learn, wh) = run(None), run(dtype)
    moved_alike([wh], [w32], [torch.tensor([1., 2.])], 0.05)  # 256x too far in fp16 before: stepped scaled
    learn, w = run(dtype, poison=True)  # an inf in the loss's own grads only: the step is skipped, the weights stay finite
    assert learn.mixed_precision.skipped_overflow == 1 and torch.isfinite(w).all()

class Poison(Callback):
    "An inf in a loss param's grad at the third step"
    order = 5
    def after_backward(self):
        if self.training and self.iter == 2 and self.epoch == 0: self.loss_func.w.grad[0] = float('inf')

class GradsAt(Callback):
    "What a callback at the default order sees at `after_backward` (fastai: after the backward, before the update)"
    def after_backward(self): self.seen = [(p.grad is not None and p.grad.dtype, p.dtype, p.is_leaf) for p in self.model.parameters()]

@dtypes
def test_after_backward_at_the_default_order_sees_fp32_params_and_grads(dtype):
    fit(tiny_model(), None, [a := GradsAt()]); fit(tiny_model(), dtype, [b := GradsAt()])
    assert b.seen == a.seen == [(torch.float32, torch.float32, True)] * 6  # None for the converted params before

class EmaSwap(Callback):
    "A copy of the model swapped into `learn.model` for validation, and the model grown by a layer at the second epoch"
    def before_validate(self): self.kept, self.learn.model = self.model, copy.deepcopy(self.model)
    def after_validate(self): self.learn.model = self.kept
    def before_epoch(self):
        if self.epoch == 1: self.learn.model = nn.Sequential(*self.model, nn.Linear(2, 2)); self.learn.create_opt()

@dtypes
def test_a_model_replaced_mid_fit_is_converted_at_its_first_batch(dtype):
    ref, learn = fit(tiny_model(), None, [EmaSwap()]), fit(tiny_model(), dtype, [EmaSwap()])
    assert len(learn.model) == len(ref.model) == 5 and fp32_everywhere(learn)  # an error before: half batch, fp32 weights
    assert learn.recorder.values[-1][1] == learn.recorder.values[-1][1]  # a validation loss, not a NaN

class Renorm(nn.Module):
    "In-place changes in the forward: an embedding with `max_norm`, a history that grows, a cache first made in flight"
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 4, max_norm=1.), nn.Linear(4, 2)
        self.register_buffer('hist', torch.zeros(0))
    def forward(self, x):
        if self.training: self.hist = torch.cat([self.hist, x.float().mean().reshape(1).to(self.hist.dtype)])  # re-assigned, a new shape
        if not hasattr(self, 'cache'): self.register_buffer('cache', torch.ones(3, dtype=x.dtype))  # first made in flight
        return self.lin(x + self.emb(torch.arange(5, device=x.device)).mean(0))  # rows 0-4 read (renormalized), 5-9 never

@dtypes
def test_what_the_forward_changes_lands_fp32(dtype):
    torch.manual_seed(0); m = Renorm()
    with torch.no_grad(): m.emb.weight.mul_(5)  # rows of norm ~10: the forward renormalizes those it reads
    n0 = m.emb.weight.detach().norm(dim=1)
    ref, learn = fit(copy.deepcopy(m), None, lr=1e-3), fit(m, dtype, lr=1e-3)
    for l in (ref, learn):
        n = l.model.emb.weight.detach().norm(dim=1)
        assert (n[:5] <= 1.05).all() and torch.equal(n[5:], n0[5:]), n  # the rows read at max_norm (4.7 before), the others as they were
        assert l.model.hist.shape == (6,) and l.model.hist.dtype == torch.float32  # ended empty before
        assert l.model.cache.dtype == torch.float32
    assert fp32_everywhere(learn)

@dtypes
def test_old_style_weight_norm_attribute_is_fp32_at_rest(dtype):
    m = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)
        torch.nn.utils.weight_norm(m[0])
    learn = fit(m, dtype)
    assert m[0].weight.dtype == torch.float32 and torch.allclose(m[0].weight, torch._weight_norm(m[0].weight_v, m[0].weight_g, 0))

class SAM(Callback):
    "Sharpness-aware minimization's ascent step: a second forward and backward at perturbed weights, in `before_step`"
    order = 9  # before MixedPrecision's step (10): its unscale and check cover these grads too
    def before_step(self):
        ps = [p for p in self.model.parameters() if p.grad is not None]
        mp = getattr(self.learn, 'mixed_precision', None)
        with torch.no_grad():
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))
            es = [0.05 * p.grad / (n + 1e-12) for p in ps]
            for p, e in zip(ps, es): p.add_(e)
        for p in ps: p.grad = None
        with (mp.in_flight() if mp else torch.enable_grad()):
            loss = self.loss_func(self.model(*self.xb).float(), *self.yb)
            (loss * (mp.loss_scale if mp else 1.)).backward()
        with torch.no_grad():
            for p, e in zip(ps, es): p.sub_(e)

@dtypes
def test_a_second_forward_in_the_step_runs_in_half_with_in_flight(dtype):
    w0 = params(Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()))
    ref, learn = fit(tiny_model(), None, [SAM()], lr=1e-3), fit(tiny_model(), dtype, [SAM()], lr=1e-3)
    moved_alike(params(learn), params(ref), w0, 0.1)
    assert fp32_everywhere(learn)

class Teacher(Callback):
    "A teacher outside `learn.model` called on `learn.xb` after the step: the batch as the DataLoader gave it"
    def __init__(self): self.teacher = tiny_model(seed=1)
    def after_step(self): self.seen = (self.xb[0].dtype, self.teacher(*self.xb).dtype)

class HalfAtRest(Callback):
    "A forward at rest on a batch made half by hand"
    def before_step(self): self.model(self.xb[0].half())

@dtypes
def test_a_forward_at_rest_runs_fp32_or_says_why_not(dtype):
    fit(tiny_model(), dtype, [t := Teacher()], epochs=1)
    assert t.seen == (torch.float32, torch.float32)  # the batch at rest is fp32; a half one failed before
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[HalfAtRest()]).to_half(dtype)
    with pytest.raises(RuntimeError) as e: learn.fit(1)
    note = '\n'.join(getattr(e.value, '__notes__', [])) + str(e.value)
    assert 'at rest' in note and 'in_flight' in note
    assert fp32_everywhere(learn)

@dtypes
def test_gradient_accumulation_sums_in_fp32_through_autograd(dtype):
    from fastai.callback.training import GradientAccumulation
    w0 = params(Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()))
    ref, learn = fit(tiny_model(), None, [GradientAccumulation(32)]), fit(tiny_model(), dtype, [GradientAccumulation(32)])
    moved_alike(params(learn), params(ref), w0, 0.05)

def test_ddp_compresses_unless_the_user_hooked():
    "DDP built on the fp32 params all-reduces its buckets in half (torch's compress hooks); a comm hook of the user's own wins"
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fastai_fp16.window import _compress
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        def own(state, bucket): return torch.futures.Future()
        a, b, c = DDP(nn.Linear(2, 2)), DDP(nn.Linear(2, 2)), DDP(nn.Linear(2, 2))
        c.register_comm_hook(None, own)
        _compress(a, torch.bfloat16); _compress(b, torch.float16); _compress(c, torch.float16)
        assert [[h.__name__ for h, _ in m._comm_hooks] for m in (a, b, c)] == [['bf16_compress_hook'], ['fp16_compress_hook'], ['own']]
    finally: dist.destroy_process_group()
