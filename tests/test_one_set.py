"One set of parameters: fastai's features that touch the model or the optimizer mid-fit meet the fp32 params, as in fp32"
import pickle, subprocess, sys, json, torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.optimizer import SGD, Adam
from fastai.torch_core import trainable_params
from fastai.callback.core import Callback, CancelStepException
from fastai_fp16.all import *
from helpers import *

def two_groups(m): return [list(m[:3].parameters()), list(m[3].parameters())]

def _fit(dtype, cbs, epochs=2, lr=1e-4, opt_func=SGD, freeze=False, dls=None, splitter=two_groups, **kw):
    learn = Learner(dls or synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss(), opt_func=opt_func, splitter=splitter, cbs=cbs, **kw)
    if freeze: learn.freeze()
    if dtype: learn.to_half(dtype, init_scale=256.)
    w0 = params(learn)
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, lr)
    return learn, [b - a for a, b in zip(w0, params(learn))]

def _close(d, ref, tol=0.2):
    "`d` moved as `ref` did: the size of the move within `tol`, in the same direction"
    n, nr = torch.linalg.vector_norm(d), torch.linalg.vector_norm(ref)
    if nr == 0: return n == 0  # too small a move for fp32 to show (BatchNorm's weight at lr 1e-6)
    return abs(n / nr - 1) < tol and torch.linalg.vector_norm(d - ref) < tol * nr

class Unfreezer(Callback):
    "Gradual unfreezing: the body joins the training at the second epoch"
    def before_epoch(self):
        if self.epoch == 1: self.learn.unfreeze()

class Freezer(Callback):
    "The body stops training at the second epoch; its weights as that epoch starts"
    def before_epoch(self):
        if self.epoch == 1: self.learn.freeze(); self.body = self.model[0].weight.detach().clone()

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_unfreeze_mid_fit_trains_the_body_as_fp32(dtype):
    (_, d32), (learn, dh) = _fit(None, Unfreezer(), freeze=True), _fit(dtype, Unfreezer(), freeze=True)
    assert _close(dh[0], d32[0]), (dh[0].norm(), d32[0].norm())  # the body's weight: 0 before this design
    assert all(p.requires_grad for p in learn.model.parameters())  # the flags fastai set

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_freeze_mid_fit_stops_the_body_and_the_flags_survive(dtype):
    for d in (None, dtype):
        learn, _ = _fit(d, fr := Freezer())
        assert torch.equal(learn.model[0].weight, fr.body)  # the body did not move after `freeze`
        assert [p.requires_grad for p in learn.model.parameters()] == [False, False, True, True, True, True]  # BatchNorm: train_bn

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_flags_set_before_the_fit_survive_it(dtype):
    learn, d = _fit(dtype, [], freeze=True, epochs=1)
    assert [p.requires_grad for p in learn.model.parameters()] == [False, False, True, True, True, True]
    assert not d[0].any() and d[-1].any()  # the frozen body did not move, the head did

class CancelEvery2nd(Callback):
    "A user's callback that cancels every second step"
    def __init__(self, order): self.order = order
    def before_step(self):
        if self.iter % 2: raise CancelStepException()
    def before_batch(self):
        if self.training and self.iter % 2 == 0:  # right after a cancelled step: no grads left behind
            self.left = getattr(self, 'left', []) + [any(p.grad is not None and p.grad.any() for p in self.model.parameters())]

@pytest.mark.parametrize('order', [0, 11, 20])
@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_a_users_cancelled_step_leaves_no_grads_behind(dtype, order):
    (_, d32), (_, dh) = _fit(None, c32 := CancelEvery2nd(order), lr=1e-6), _fit(dtype, ch := CancelEvery2nd(order), lr=1e-6)
    assert not any(c32.left) and not any(ch.left) and len(ch.left) == 6
    for a, b in zip(dh, d32): assert _close(a, b, 0.05), (a.norm(), b.norm())  # 1.29x fp32's move before this design

class ExportEachEpoch(Callback):
    "A deployable model each epoch: `learn.export()` from `after_epoch`, and the weights it holds then"
    order = 60
    def after_epoch(self):
        if self.epoch: return
        learn = self.learn
        with learn.removed_cbs(self): learn.export('mid.pkl')  # (this test's callback would need this test's module)
        self.w = params(learn)

_load_plain = '''
import sys, json, torch
sys.modules['fastai_fp16'] = None  # as on a machine without fastai_fp16: importing it fails
from fastai.learner import load_learner
learn = load_learner(sys.argv[1])
print(json.dumps({'w': [p.tolist() for p in learn.model.parameters()], 'dtypes': sorted({str(p.dtype) for p in learn.model.parameters()}),
                  'cbs': [type(cb).__module__ for cb in learn.cbs]}))
'''

def plain_dls(n=128, bs=16):
    "DataLoaders whose transforms pickle without this test's modules (which import fastai_fp16)"
    from fastai.data.core import Datasets
    from fastai.data.transforms import IndexSplitter
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g); y = x @ torch.randn(4, 2, generator=g)
    dsets = Datasets(list(range(n)), [[x.__getitem__], [y.__getitem__]], splits=IndexSplitter(range(n*3//4, n))(range(n)))
    return dsets.dataloaders(bs=bs, shuffle=False, device='cpu')

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_export_mid_fit_loads_without_us_and_training_goes_on(tmp_path, dtype):
    mk = lambda cbs: _fit(dtype, cbs, opt_func=Adam, lr=1e-2, dls=plain_dls(), splitter=trainable_params, path=tmp_path)[0]
    plain, exp = mk([]), mk(ex := ExportEachEpoch())
    assert all(torch.equal(a, b) for a, b in zip(params(exp), params(plain)))  # training after the export as without it
    r = subprocess.run([sys.executable, '-c', _load_plain, str(tmp_path/'mid.pkl')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got['dtypes'] == ['torch.float32'] and not any(m.startswith('fastai_fp16') for m in got['cbs'])
    assert all(torch.equal(torch.tensor(a), b) for a, b in zip(got['w'], ex.w))  # that moment's fp32 weights

class Pickle(Callback):
    "`pickle.dumps(learn.model)` mid-fit"
    def after_batch(self):
        if self.training and self.iter == 1: self.m, self.w = pickle.loads(pickle.dumps(self.learn.model)), params(self.learn)

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_the_model_pickles_mid_fit(dtype):
    learn, _ = _fit(dtype, pk := Pickle(), epochs=1, lr=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(pk.m.parameters(), pk.w))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in pk.m.modules())


@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
@pytest.mark.parametrize('acc', [False, True])
def test_no_host_sync_a_step(dtype, acc):
    from fastai.callback.training import GradientAccumulation
    sc = SyncCount()
    learn, _ = _fit(dtype, [sc] + ([GradientAccumulation(32)] if acc else []), epochs=2, lr=1e-3, opt_func=Adam)
    # fastai's `Adam` steps in the fused kernel, which reads the skip flag on the device: one read at each epoch's end (what
    # the device decided, told), and once a fit the buffers a forward changes; none a step (issue 63)
    assert sc.steps == (6 if acc else 12) and sc.n == 2 + 1

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_torch_compile_compiles_no_more_than_fp32(dtype):
    "A `torch.compile`d model: the casts in flight are new tensors each batch, inputs to the graph, so dynamo compiles as often as in fp32"
    from torch._dynamo.utils import counters
    graphs = []
    for d in (None, dtype):
        torch._dynamo.reset(); counters.clear()
        m = tiny_model()
        learn = Learner(synth_dls(n=128, bs=16), torch.compile(m, backend='aot_eager'), loss_func=nn.MSELoss())
        if d: learn.to_half(d, init_scale=256.)
        w = [p.detach().clone() for p in m.parameters()]
        with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
        graphs.append(counters['stats']['unique_graphs'])
        assert any(not torch.equal(a, b) for a, b in zip(w, m.parameters())) and fp32_everywhere(learn)
    assert graphs[1] == graphs[0] and not counters['recompiles'], (graphs, dict(counters['recompiles']))

def test_a_param_replaced_mid_fit_is_not_overwritten_by_the_old_ones_copy():
    "`load_state_dict(assign=True)` from a callback puts new Parameters in the model: they are used, never the old ones' copies"
    class Assign(Callback):
        def after_epoch(self):
            if self.epoch: return
            self.sd = {k: (v * 0.5).clone() for k,v in self.model.state_dict().items()}
            self.model.load_state_dict(self.sd, assign=True)
            self.new = self.model[0].weight
    learn, _ = _fit('bf16', a := Assign(), lr=0.)  # lr 0: the new weights stay as they were assigned
    assert learn.model[0].weight is a.new and torch.equal(learn.model[0].weight, a.sd['0.weight'])
