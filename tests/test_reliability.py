"Issue 3: faults, bad input, wrong use, checkpoints and export"
import re, torch, torch.nn as nn, pytest, tempfile
from pathlib import Path
from fastai.learner import Learner, load_learner
from fastai.optimizer import SGD, Adam, OptimWrapper
from fastai.callback.core import Callback
from fastai.callback.tracker import SaveModelCallback
from fastai_fp16.all import *
from helpers import *

class Snap(Callback):
    "Weights before and after training batch `at`, and after every step: at rest, fp32 (before our `before_batch`)"
    order = 0
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.training and self.iter == self.at: self.before = params(self.learn)
    def after_batch(self):
        if self.training and self.iter == self.at: self.after = params(self.learn)
    def after_step(self): self.masters = params(self.learn)  # at rest: the fp32 params the optimizer stepped

def test_nan_batch_is_skipped():
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    x[16:24] = float('nan')  # the third training batch
    snap = Snap(2)
    learn = Learner(dls_from(x, y, bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, cbs=snap).to_half('fp16', init_scale=256.)
    learn.fit(1, 1e-2)
    mp = learn.mixed_precision
    assert mp.skipped == 1 and mp.loss_scale == 256.          # skipped, and the scale not blamed
    for a, b in zip(snap.before, snap.after): assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in learn.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(snap.after, params(learn)))  # later batches trained

def test_nan_micro_batch_skips_its_step():
    "With GradientAccumulation, a NaN in a step's first micro-batch (not its last) still skips that step, without blame"
    from fastai.callback.training import GradientAccumulation
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    x[0:8] = float('nan')  # the first batch of the first 4-batch step
    learn = Learner(dls_from(x, y, bs=8), tiny_model(bn=False), loss_func=nn.MSELoss(), opt_func=Adam,
                    cbs=GradientAccumulation(32)).to_half('fp16', init_scale=256.)
    w = params(learn)
    learn.fit(1, 1e-2)  # 6 batches: the step after batch 4 is skipped, the last 2 do not step
    mp = learn.mixed_precision
    assert mp.skipped == 1 and mp.loss_scale == 256.  # skipped, and the scale not blamed for bad data
    assert all(torch.equal(a, b) for a, b in zip(w, params(learn)))

class BNSnap(Callback):
    "The model's buffers (BatchNorm's running stats and count) before training batch `first` and after batch `last`"
    order = 100
    def __init__(self, first, last): self.first, self.last = first, last
    def before_batch(self):
        if self.training and self.iter == self.first: self.before = [b.clone() for b in self.model.buffers()]
    def after_batch(self):
        if self.training and self.iter == self.last: self.after = [b.clone() for b in self.model.buffers()]

def test_nan_value_leaves_batchnorm_stats_exact():
    "Issue 14: one NaN value skips the step and leaves running_mean/var and num_batches_tracked as before that batch"
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    x[17, 2] = float('nan')  # one value, in the third training batch
    snap = BNSnap(2, 2)
    learn = Learner(dls_from(x, y, bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, cbs=snap).to_half('fp16', init_scale=256.)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 1
    assert len(snap.before) == 3 and all(torch.equal(a, b) for a, b in zip(snap.before, snap.after))
    assert all(torch.isfinite(b).all() for b in learn.model.buffers() if b.is_floating_point())
    assert torch.isfinite(torch.tensor(learn.validate()[0]))
    assert learn.model[1].num_batches_tracked == 5  # the 5 clean batches of 6

def test_nan_micro_batch_restores_the_whole_steps_stats():
    "With GradientAccumulation, a skipped step puts back what all of its micro-batches' forwards changed"
    from fastai.callback.training import GradientAccumulation
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    x[9, 0] = float('inf')  # in the second micro-batch of the first 4-batch step
    snap = BNSnap(0, 3)
    learn = Learner(dls_from(x, y, bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam,
                    cbs=[GradientAccumulation(32), snap]).to_half('fp16', init_scale=256.)
    learn.fit(1, 1e-2)
    assert learn.mixed_precision.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(snap.before, snap.after))
    assert torch.isfinite(torch.tensor(learn.validate()[0]))

def _usable(learn):
    assert fp32_everywhere(learn) and opt_on_model(learn)
    learn.fit(1, 1e-3)
    assert fp32_everywhere(learn)

def test_scale_collapse_raises_clear_error():
    learn = Learner(synth_dls(n=256, bs=8), tiny_model(), loss_func=lambda p, y: (p.float()*1e6).sum()).to_half('fp16')
    with pytest.raises(LossScaleError, match='minimum loss scale') as e: learn.fit(1, 1e-2)
    assert 'bf16' in str(e.value) and 'learning rate' in str(e.value)
    assert learn.mixed_precision.skipped == 17
    learn.loss_func = nn.MSELoss(); _usable(learn)

def test_consecutive_skips_raise():
    learn = Learner(synth_dls(n=256, bs=8), tiny_model(), loss_func=lambda p, y: (p.float()*1e6).sum()).to_half('fp16', init_scale=4., dynamic=False, max_consecutive_skips=5)
    with pytest.raises(LossScaleError, match='5 optimizer steps in a row'): learn.fit(1, 1e-2)

@pytest.mark.parametrize('dtype,kw,loss', [('fp16', {}, lambda p, y: (p.float()*1e6).sum()),  # dynamic scale, collapses
                                           ('bf16', dict(max_consecutive_skips=3), lambda p, y: p.float().sum()*float('nan'))])
def test_loss_scale_error_calls_work_as_pasted(dtype, kw, loss):
    "Issue 34.6: every call a LossScaleError suggests runs on the Learner it came from, and passes no default value"
    import re, ast, inspect
    learn = Learner(synth_dls(n=256, bs=8), tiny_model(), loss_func=loss).to_half(dtype, **kw)
    with pytest.raises(LossScaleError) as e: learn.fit(1, 1e-2)
    calls = re.findall(r"`(learn\.[^`]*)`", str(e.value))
    assert len(calls) >= 2, str(e.value)
    sig = inspect.signature(Learner.to_half).parameters
    learn.loss_func = nn.MSELoss()
    for c in calls:
        for node in ast.walk(ast.parse(c)):
            if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'to_half':
                given = dict(zip(['dtype'], map(ast.literal_eval, node.args))) | {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                assert all(v != sig[k].default for k,v in given.items()), (c, 'suggests a default')
                want = half_dtype(given['dtype'])
        res = eval(c, {'learn': learn})  # as pasted where the error happened
        assert res is learn
        got = getattr(learn, 'model_to_half', None)
        if 'to_half' in c: assert got is not None and got.dtype == want, c
        else: assert not any(isinstance(cb, (ModelToHalf, MixedPrecision)) for cb in learn.cbs), c
        learn.fit(1, 1e-3)  # and it trains
        assert fp32_everywhere(learn)

def test_exception_mid_fit_leaves_learner_usable():
    class Boom(Callback):
        def after_loss(self):
            if self.training and self.iter == 3: raise RuntimeError('boom')
    snap = Snap(-1)
    learn = Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, cbs=[Boom(), snap]).to_half('fp16', init_scale=256.)
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1, 1e-2)
    got = torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()])
    assert torch.equal(got, torch.cat([m.reshape(-1) for m in snap.masters]))  # the model holds the masters' values
    assert all(learn.opt.state[p].get('grad_avg') is not None for p in learn.model.parameters())
    assert not learn.model._state_dict_hooks
    assert 'step' not in learn.opt.__dict__  # fastai's own step again, not the fit's fused one
    learn.remove_cb(Boom); _usable(learn)

class MultiIO(nn.Module):
    "Float features, integer ids and a bool mask in; a dict and a tuple out; a float buffer that never changes"
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 2)
        self.register_buffer('const', torch.linspace(0, 1, 4) + 1e-4)
        self.seen = []
    def forward(self, x, ids, mask):
        self.seen.append((x.dtype, ids.dtype, mask.dtype))
        h = (x + self.emb(ids) * self.const) * mask[:, None]
        return {'out': self.lin(h), 'aux': (h.sum(1),)}

def test_nested_inputs_and_outputs():
    n = 48
    ds = [((torch.randn(4), torch.randint(0, 10, ()), torch.rand(()) > .2), torch.randn(2)) for _ in range(n)]
    from fastai.data.core import DataLoaders
    dls = DataLoaders.from_dsets(ds[:32], ds[32:], bs=8, shuffle=False, device='cpu')
    dls.n_inp = 1
    seen = []
    def loss(pred, y):
        seen.append((pred['out'].dtype, pred['aux'][0].dtype))
        return nn.functional.mse_loss(pred['out'], y)
    model = MultiIO(); const = model.const.clone()
    class Unpack(Callback):
        order = 5
        def before_batch(self): self.learn.xb = self.xb[0]
    learn = Learner(dls, model, loss_func=loss, cbs=Unpack()).to_half('fp16')
    learn.fit(1, 1e-2)
    assert set(model.seen) == {(torch.float32, torch.long, torch.bool)}  # the batch as it came: the ops cast what they compute in half
    assert set(seen) == {(torch.float32, torch.float32)}
    assert torch.equal(model.const, const) and model.const.dtype == torch.float32

def test_frozen_params_and_discriminative_lrs():
    m = tiny_model(bn=False)
    groups = [list(m[0].parameters()), list(m[3].parameters())]
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), opt_func=SGD, splitter=lambda _: groups).to_half('fp16')
    w0 = params(learn)
    learn.fit(1, lr=[0., 1e-2])   # group 0 at lr 0 must not move, not even by a rounding
    w1 = params(learn)
    assert all(torch.equal(a, b) for a, b in zip(w0[:2], w1[:2])) and not torch.equal(w0[2], w1[2])
    m[3].weight.requires_grad_(False)
    learn.fit(1, lr=1e-2)
    assert torch.equal(m[3].weight, w1[2]) and not torch.equal(m[0].weight, w1[0])

def test_wrong_use_is_caught_at_before_fit():
    class Split(Callback):  # after fastai moved the model (TrainEvalCallback), before ModelToHalf: one param elsewhere
        order = 0
        def before_fit(self): self.model[3].bias = nn.Parameter(torch.zeros(2, device='meta'))
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=Split()).to_half('fp16')
    with pytest.raises(ValueError, match='needs the model on one device'): learn.fit(1)
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16')
    learn.add_cb(ModelToHalf(torch.float16))
    with pytest.raises(ValueError, match='more than once'): learn.fit(1)

def test_resume_from_save_model_callback():
    tmp = Path(tempfile.mkdtemp())
    def mk(): return Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, path=tmp).to_half('fp16', growth_interval=4)
    a = mk()
    a.fit(3, 1e-2, cbs=SaveModelCallback(every_epoch=True, with_opt=True))
    sd = torch.load(tmp/'models/model_0.pth', weights_only=False)
    assert {v.dtype for v in sd['model'].values() if v.is_floating_point()} == {torch.float32}
    assert any((v != v.half().float()).any() for v in sd['model'].values() if v.is_floating_point())  # not fp16-rounded
    b = mk(); b.load('model_0')
    b.fit(3, 1e-2, start_epoch=1)
    for x, y in zip(params(a), params(b)): assert torch.equal(x, y)
    assert a.mixed_precision.state_dict() == b.mixed_precision.state_dict()

def test_load_during_fit_goes_on_from_the_loaded_weights(tmp_path):
    "`learn.load` from a callback mid-fit: the rest of the fit trains from the loaded weights, optimizer state and loss scale"
    class Loader(Callback):
        def after_epoch(self):
            if self.epoch == 0: self.learn.load('w')
    mk = lambda: Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, path=tmp_path).to_half('fp16', init_scale=256.)
    a = mk(); a.fit(1, 1e-2); a.save('w')  # weights, Adam's state and the loss scaler's
    b = mk(); b.fit(2, 1e-2, cbs=Loader())  # epoch 0 trains from other weights, then loads 'w'
    c = mk(); c.load('w'); c.fit(1, 1e-2)   # what epoch 1 of b must be
    assert all(torch.equal(x, y) for x, y in zip(params(b), params(c))) and fp32_everywhere(b)
    assert b.mixed_precision.state_dict() == c.mixed_precision.state_dict()

class Seen(Callback):
    "The dtypes of the model's params at each batch"
    def before_fit(self): self.dtypes = set()
    def after_pred(self): self.dtypes |= {p.dtype for p in self.model.parameters()}

def test_export_and_load_learner():
    tmp = Path(tempfile.mkdtemp())
    learn = Learner(exportable_dls(), tiny_model(), loss_func=nn.MSELoss(), path=tmp).to_half('fp16')
    learn.fit(1, 1e-2)
    half = learn.get_preds()[0]  # as the fit's validation computes (fp16 storage, fp32 math on a CPU)
    learn.export('e.pkl')
    new = load_learner(tmp/'e.pkl')
    assert fp32_everywhere(new)
    for cb in new.cbs:
        for v in cb.__dict__.values(): assert not (isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16))
        assert not set(getattr(cb, '_stateattrs', ())) & set(cb.__dict__)
    new.dls = learn.dls
    seen = Seen()
    preds = new.get_preds(cbs=seen)[0]
    assert seen.dtypes == {torch.float32}  # the exported Learner is plain fp32: it predicts in fp32
    learn.to_float()
    assert torch.equal(learn.get_preds()[0], preds)  # the same as the plain fp32 model's
    assert torch.allclose(half, preds, rtol=1e-2, atol=1e-2) and not torch.equal(half, preds)  # fp16's figures, near fp32's
    assert all(torch.equal(a, b) for a, b in zip(new.model.parameters(), learn.model.parameters()))

def test_exception_mid_fit_cleans_diagnostics():
    from fastai_fp16.monitor import PrecisionMonitor
    class Boom(Callback):
        def after_loss(self):
            if self.training and self.iter == 1: raise RuntimeError('boom')
    x, y = torch.rand(40, 3, 8, 8), torch.randint(0, 2, (40,))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(dls_from(x, y, bs=8, n_valid=8), model, loss_func=nn.CrossEntropyLoss(),
                    cbs=[Boom(), PrecisionMonitor(every=1)]).to_half('fp16', fp32_math=True)  # fp16 layers patched for fp32 math
    metrics = list(learn.metrics)
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1, 1e-2)
    assert '_conv_forward' not in model[0].__dict__ and 'forward' not in model[5].__dict__ and list(learn.metrics) == metrics
    assert fp32_everywhere(learn) and opt_on_model(learn)

def test_misuse_in_validate_does_not_leave_fastai_locked():
    "fastai 2.8.7 leaves `learn.lock` held when `before_fit` raises in `validate`: our errors come at the first batch"
    import threading
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[ModelToHalf(torch.float16), ModelToHalf(torch.float16), MixedPrecision()])
    errors = []
    def twice():
        for _ in range(2):
            try: learn.validate()
            except ValueError as e: errors.append(str(e))
    t = threading.Thread(target=twice, daemon=True); t.start(); t.join(60)
    assert not t.is_alive(), 'the second validate hung'
    assert len(errors) == 2 and all('more than once' in e for e in errors)
    assert fp32_everywhere(learn) and not learn.lock.locked()

_load_plain = '''
import sys, json
sys.modules['fastai_fp16'] = None  # as on a machine without fastai_fp16: importing it fails
from fastai.learner import load_learner
learn = load_learner(sys.argv[1])
print(json.dumps({'pred': learn.predict(3)[0].tolist(), 'cbs': [type(cb).__module__ for cb in learn.cbs],
                  'dtypes': sorted({str(p.dtype) for p in learn.model.parameters()})}))
'''

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_export_loads_without_fastai_fp16(dtype):
    "Issue 14.2: `export` after `to_half` writes a plain fp32 Learner; the Learner you hold keeps its callbacks"
    import subprocess, sys, json
    from fastai.data.core import Datasets
    from fastai.data.transforms import IndexSplitter
    tmp = Path(tempfile.mkdtemp())
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    dsets = Datasets(list(range(64)), [[x.__getitem__], [y.__getitem__]], splits=IndexSplitter(range(48, 64))(range(64)))
    learn = Learner(dsets.dataloaders(bs=16, shuffle=False, device='cpu'), tiny_model(), loss_func=nn.MSELoss(), path=tmp).to_half(dtype)
    learn.fit(1, 1e-2)
    cbs = list(learn.cbs)
    learn.export('e.pkl')
    assert list(learn.cbs) == cbs and type(learn.mixed_precision) is MixedPrecision and type(learn.model_to_half) is ModelToHalf
    r = subprocess.run([sys.executable, '-c', _load_plain, str(tmp/'e.pkl')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got['dtypes'] == ['torch.float32'] and not any(m.startswith('fastai_fp16') for m in got['cbs'])
    with torch.no_grad(): expected = learn.model.eval()(x[3:4])[0]
    assert torch.allclose(torch.tensor(got['pred']), expected, atol=1e-6), (got['pred'], expected)

def _Dtypes():
    "The dtype the first layer computes in, and BatchNorm's params and running stats, in the training forwards"
    return InForward(lambda m: m[0], lambda l, o: (o.dtype, l.model[1].weight.dtype, l.model[1].running_var.dtype))

@pytest.mark.parametrize('made,dtype', [(torch.float16, 'fp16'), (torch.float16, 'bf16'), (torch.bfloat16, 'fp16')])
def test_half_model_is_made_fp32_first(made, dtype):
    "Issue 14.3: a model already half before `to_half` is converted to fp32 first (exactly, said once), never left half"
    m = tiny_model().to(made)
    w = [p.detach().float() for p in m.parameters()]  # the exact fp32 values of its half weights
    spy = _Dtypes()
    learn = Learner(synth_dls(), m, loss_func=nn.MSELoss(), cbs=spy).to_half(dtype, init_scale=256.)
    with pytest.warns(UserWarning, match='already half') as rec: learn.validate()
    assert len([r for r in rec if 'already half' in str(r.message)]) == 1
    assert fp32_everywhere(learn) and all(torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))
    learn.fit(1, 1e-2)
    half = half_dtype(dtype)
    assert spy.seen == {(half, torch.float32, torch.float32)}  # BatchNorm fp32 during the fit
    assert fp32_everywhere(learn) and opt_on_model(learn)

def test_half_model_said_at_each_fit_it_is_half():
    "Issue 56.8: made half again between fits, it is converted again and said again, at the user's line, with the dtypes it had"
    import warnings
    learn = Learner(synth_dls(), tiny_model().half(), loss_func=nn.MSELoss()).to_half('fp16', init_scale=256.)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('default')
        learn.fit(1, 1e-2)
        learn.model.bfloat16()
        learn.fit(1, 1e-2)
        learn.fit(1, 1e-2)  # fp32 since the last: nothing to say
    said = [w for w in ws if 'already half' in str(w.message)]
    assert len(said) == 2 and {w.filename for w in said} == {__file__} and fp32_everywhere(learn)
    assert 'in torch.float16,' in str(said[0].message) and 'in torch.bfloat16,' in str(said[1].message)

@pytest.mark.parametrize('method,fix', [('to_fp16', 'learn.to_fp32()'), ('to_bf16', 'learn.to_fp32()'),
                                        ('to_non_native_fp16', 'learn.to_non_native_fp32()')])
def test_two_precision_systems_are_refused(method, fix):
    "Issue 14.4: fastai's own mixed precision and `to_half()`, in either order, fail at once and say how to keep one"
    import re
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16')
    cbs = list(learn.cbs)
    with pytest.raises(ValueError, match=re.escape('learn.to_float()')): getattr(learn, method)()
    assert list(learn.cbs) == cbs and type(learn.mixed_precision) is MixedPrecision  # nothing added
    learn = getattr(Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()), method)()
    with pytest.raises(ValueError, match=re.escape(fix)): learn.to_half('fp16')
    assert not any(type(cb).__module__.startswith('fastai_fp16') for cb in learn.cbs)
    getattr(learn, fix.split('.')[1][:-2])()  # as the message says
    learn.to_half('fp16').fit(1, 1e-2)
    assert fp32_everywhere(learn) and learn.mixed_precision.skipped < 3

def test_fastai_mixed_precision_with_our_model_to_half_names_both():
    from fastai.callback.fp16 import MixedPrecision as FastaiMixedPrecision
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[ModelToHalf(torch.float16), FastaiMixedPrecision()])
    with pytest.raises(ValueError) as e: learn.fit(1)
    assert "fastai's own mixed precision (MixedPrecision from fastai.callback.fp16" in str(e.value)
    assert 'fastai_fp16.half_model.ModelToHalf' in str(e.value) and 'there is no' not in str(e.value)
    assert fp32_everywhere(learn)

class _NormAfterClip(Callback):
    "The global norm of the grads the optimizer steps (after fastai's GradientClip, order 11)"
    order = 20
    def before_fit(self): self.norms = []
    def before_step(self):
        gs = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])).item())

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_fastai_gradient_clip_clips_the_fp32_unscaled_grads(dtype):
    "fastai's GradientClip with `to_half()` clips the fp32 params' unscaled grads: it moves as fp32 + GradientClip does"
    from fastai.callback.training import GradientClip
    runs = []
    for how in ('fp32', 'half', 'clip='):
        spy = _NormAfterClip()
        learn = Learner(synth_dls(bs=8), tiny_model(), loss_func=nn.MSELoss(), opt_func=SGD, cbs=spy)
        if how != 'fp32': learn.to_half(dtype, init_scale=256., **(dict(clip=0.05) if how == 'clip=' else {}))
        w = params(learn)
        learn.fit(1, 1e-2, cbs=[] if how == 'clip=' else GradientClip(0.05))
        runs.append(([b - a for a, b in zip(w, params(learn))], spy.norms))
        if how != 'fp32': assert learn.mixed_precision.skipped == 0 and fp32_everywhere(learn)
    (d32, n32), (dh, nh), (dc, nc) = runs
    assert max(nh) <= 0.05 * (1 + 1e-4) and max(nc) <= 0.05 * (1 + 1e-4) and len(nh) == len(n32) == 6
    for a, b, c in zip(d32, dh, dc):
        assert torch.allclose(b, a, rtol=0.2, atol=2e-4) and torch.equal(b, c)  # as fp32; `clip=` is the same clip

class _NewZeros(nn.Module):
    "A forward that makes an fp32 tensor of its own (`torch.zeros` without a dtype) and adds half activations into it"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x): return self.b(torch.zeros(x.shape[0], 8).index_add(0, torch.arange(x.shape[0]), self.a(x)))

def test_two_dtypes_error_gets_one_hint():
    "Issue 14.6: torch's two-dtypes error (`index_add`'s here) is raised as is, with one note naming the cause"
    for kw in (dict(autocast=False), {}):  # every op in half, and under the op policy (which lowers no `index_add`)
        learn = Learner(synth_dls(), _NewZeros(), loss_func=nn.MSELoss()).to_half('bf16', fp32_math=False, **kw)
        with pytest.raises(RuntimeError, match='must have the same scalar type') as e: learn.fit(1)
        notes = [n for n in getattr(e.value, '__notes__', []) if 'fastai_fp16' in n]
        assert len(notes) == 1 and 'x.new_zeros(n)' in notes[0] and 'keep_fp32' in notes[0] and ('autocast=False' in notes[0]) == bool(kw)
        assert fp32_everywhere(learn)
    learn.to_float().to_half('bf16', fp32_math=False, keep_fp32=['']).fit(1, 1e-2)  # the whole model in fp32: it runs
    call = re.search(r"`(learn\.to_float\(\)\.to_half\(.*?\))`", notes[0]).group(1)  # the note's call, as pasted where it came
    eval(call.replace("'its.name'", "''"), {'learn': learn}).fit(1, 1e-2)              # (the root module's name: '')
    assert learn.model_to_half.dtype == torch.bfloat16

@pytest.mark.parametrize('kw', [dict(growth_factor=float('inf')), dict(max_scale=float('inf')), dict(min_scale=float('nan')),
                                dict(growth_interval=float('inf')), dict(hysteresis=float('nan')), dict(max_consecutive_skips=float('inf'))])
def test_non_finite_scaler_settings_refused(kw):
    (k, v), = kw.items()
    with pytest.raises(ValueError, match=f"^{k} must be"): MixedPrecision(**kw)

BAD_STATES = [('scale', float('nan')), ('scale', float('inf')), ('scale', 0.), ('scale', -4.), ('scale', 'x'),
              ('growth_tracker', -1), ('consecutive_skips', 2.5), ('hysteresis_tracker', None), ('growth_factor', float('inf'))]

@pytest.mark.parametrize('key,value', BAD_STATES)
def test_corrupt_scaler_state_refused_and_nothing_changed(key, value):
    a = MixedPrecision(growth_interval=3)
    for f in (False, True, False): a.scaler.update(f)
    before, sd = a.state_dict(), a.state_dict()
    sd['dtype'] = 'torch.bfloat16'  # a valid entry that must not be taken either
    sd['scaler'] = {**sd['scaler'], 'growth_tracker': 2, key: value}
    with pytest.raises(ValueError, match=f"loss-scaler state: '{key}' must be .*, got {value!r}"): a.load_state_dict(sd)
    assert a.state_dict() == before

def test_unknown_dtype_in_state_refused():
    a = MixedPrecision(); before = a.state_dict()
    with pytest.raises(ValueError, match="'dtype' must be one of"): a.load_state_dict({**before, 'dtype': 'torch.float64'})  # fp32: an fp32 plan's (issue 54)
    assert a.state_dict() == before

@pytest.mark.parametrize('key,value', [('scale', float('nan')), ('scale', 'x'), ('dtype', 'fp8')])
def test_learn_load_of_corrupt_scaler_state_raises(tmp_path, key, value):
    mk = lambda: Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss(), opt_func=Adam, path=tmp_path).to_half('fp16')
    a = mk(); a.fit(1, 1e-2); a.save('ep1')
    f = tmp_path/'models/ep1.pth'
    sd = torch.load(f, weights_only=False)
    mps = sd['opt']['mixed_precision']
    if key == 'dtype': mps['dtype'] = value
    else: mps['scaler'][key] = value
    torch.save(sd, f)
    b = mk(); b.create_opt()
    before, opt_before = b.mixed_precision.state_dict(), b.opt.state_dict()
    with pytest.raises(ValueError, match=f"ep1.*cannot be loaded: .*'{key}' must be") as e: b.load('ep1')
    assert b.mixed_precision.state_dict() == before
    call = re.search(r"`(learn\.load\(.*?\))`", str(e.value)).group(1)  # the call the error suggests works as pasted
    eval(call, {'learn': b})
    assert all(torch.equal(p, q) for p,q in zip(b.model.parameters(), a.model.parameters()))
    assert b.opt.state_dict()['state'] == opt_before['state']  # the optimizer left as it was: no step counts, no averages
    assert not any('grad_avg' in s for s in b.opt.state_dict()['state']) and any('grad_avg' in s for s in sd['opt']['state'])
