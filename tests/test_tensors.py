"Tensors a half fit must leave alone (fp64, sparse grads), bf16 grads without masters as on CUDA, and syncs outside a fit"
import sys, torch, torch.nn as nn, pytest
from functools import partial
from fastai.learner import Learner
from fastai.optimizer import SGD, OptimWrapper
from fastai.callback.core import Callback
from fastai_fp16.all import *
from helpers import *

class Gain(nn.Module):
    "tiny_model times a learned fp64 gain; an fp64 buffer counts the samples seen in training"
    def __init__(self):
        super().__init__(); self.body = tiny_model()
        self.gain = nn.Parameter(torch.tensor([2/3], dtype=torch.float64))
        self.register_buffer('seen', torch.zeros((), dtype=torch.float64))
    def forward(self, x):
        if self.training: self.seen += x.shape[0]
        return self.body(x) * self.gain.to(x.dtype)

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_fp64_params_and_buffers_keep_their_dtype_and_values(dtype):
    runs = []
    for d in (None, dtype):
        learn = Learner(synth_dls(n=640, bs=16), Gain(), loss_func=nn.MSELoss())
        if d: learn.to_half(d)
        learn.fit(1, 0)  # lr 0: nothing moves
        runs.append(learn.model)
    (m32, mh) = runs
    assert mh.gain.dtype == torch.float64 and mh.gain.item() == 2/3  # not 0.6666666865348816
    assert mh.seen.dtype == torch.float64 and mh.seen == m32.seen == 480  # not rounded to bf16 on the way
    assert all(p.dtype == torch.float32 for p in mh.body.parameters())

class Bag(nn.Module):
    "A sparse embedding (its grads are sparse) into a linear layer"
    def __init__(self):
        super().__init__(); torch.manual_seed(0); self.emb, self.lin = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 2)
    def forward(self, x): return self.lin(self.emb(x))

def _bag_fit(dtype, **kw):
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 20, (64,), generator=g), torch.randn(64, 2, generator=g)
    learn = Learner(dls_from(ids, y, bs=8), Bag(), loss_func=nn.MSELoss(), opt_func=partial(OptimWrapper, opt=torch.optim.SGD))
    if dtype: learn.to_half(dtype, **kw)
    w = params(learn)
    learn.fit(1, 1e-2)
    return learn, [b - a for a, b in zip(w, params(learn))]

@pytest.mark.parametrize('dtype,kw', [('fp16', dict(init_scale=256.)), ('bf16', {}), ('fp16', dict(init_scale=256., keep_fp32=['emb']))])
def test_sparse_grads_train_as_fp32(dtype, kw):
    "An `Embedding(sparse=True)` stays fp32 (its sparse grads unscaled and checked as they are); the rest computes in half"
    (_, d32), (learn, dh) = _bag_fit(None), _bag_fit(dtype, **kw)
    assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn)
    for a, b in zip(dh, d32): assert torch.allclose(a, b, rtol=0.05, atol=2e-3), (a - b).abs().max()
    assert dh[0].any()  # the embedding trained

def test_sparse_grad_overflow_is_caught():
    "A non-finite value in a sparse grad skips the step like any other"
    g = torch.sparse_coo_tensor([[0, 2]], torch.tensor([[1., 2.], [float('inf'), 0.]]), (4, 2))
    fi = torch.zeros(1)
    unscale_grads_([g, torch.ones(3)], torch.full((1,), .5), fi)
    assert fi.item() == 1 and g._values()[0].tolist() == [.5, 1.]

def _cuda_like_unscale(monkeypatch):
    "torch's CUDA check-and-unscale kernel has no bf16 (pytorch/pytorch#127176); the CPU one has: refuse it as CUDA does"
    real = torch._amp_foreach_non_finite_check_and_unscale_
    def no_bf16(gs, fi, inv):
        if any(g.dtype == torch.bfloat16 for g in gs): raise RuntimeError('"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for \'BFloat16\'')
        return real(gs, fi, inv)
    monkeypatch.setattr(torch, '_amp_foreach_non_finite_check_and_unscale_', no_bf16)

@pytest.mark.parametrize('scale', [1., 256.])
def test_bf16_grads_are_checked_and_unscaled_without_the_amp_kernel(monkeypatch, scale):
    _cuda_like_unscale(monkeypatch)
    gs = [torch.tensor([1., -2.], dtype=torch.bfloat16) * scale, torch.tensor([4.], dtype=torch.bfloat16) * scale]
    fi = torch.zeros(1)
    unscale_grads_(gs, torch.full((1,), 1/scale), fi, scale)
    assert fi.item() == 0 and gs[0].tolist() == [1., -2.] and gs[1].tolist() == [4.]
    for bad in (float('inf'), float('nan')):
        fi = torch.zeros(1)
        unscale_grads_([torch.ones(2, dtype=torch.bfloat16), torch.tensor([bad, 1.], dtype=torch.bfloat16)], torch.ones(1), fi, 1.)
        assert fi.item() == 1

def test_bf16_without_masters_trains_where_the_kernel_lacks_bf16(monkeypatch):
    "The study's rung `to_half('bf16', master_weights=False)` failed at the first step on a GPU"
    _cuda_like_unscale(monkeypatch)
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=SGD).to_half('bf16', master_weights=False)
    w = params(learn)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn) and any(not torch.equal(a, b) for a, b in zip(w, params(learn)))

def test_predictions_make_no_host_sync_of_ours():
    "`validate`, `get_preds` and `predict` in half (bf16 assumed fast here) leave the fp32 params untouched: nothing to check"
    learn = Learner(exportable_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16')
    n = [0]
    def count(f):
        def g(t, *a, **k):
            if sys._getframe(1).f_globals.get('__name__', '').startswith('fastai_fp16'): n[0] += 1
            return f(t, *a, **k)
        return g
    fs = {(o,k): getattr(o, k) for o,ks in ((torch.Tensor, ('item', 'tolist', '__bool__')), (torch, ('equal',))) for k in ks}
    w = params(learn)
    with assume_capabilities(cpu_caps('avx512_bf16')), learn.no_bar(), learn.no_logging():
        try:
            for (o,k),f in fs.items(): setattr(o, k, count(f))
            learn.validate(); learn.get_preds(); learn.predict(0)
        finally:
            for (o,k),f in fs.items(): setattr(o, k, f)
    assert n[0] == 0 and all(torch.equal(a, b) for a, b in zip(w, params(learn)))
