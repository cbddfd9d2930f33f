"Hardware-aware precision: what `to_half` runs for each class of hardware (capabilities injected), and that it trains"
import warnings, pytest, torch, torch.nn as nn
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.losses import CrossEntropyLossFlat
from fastai_fp16.all import *
from fastai_fp16.core import synth_dls, tiny_model
from helpers import dls_from, params, fp32_everywhere, InForward

def conv_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

def conv_dls(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dls_from(torch.rand(40, 3, 8, 8, generator=g), torch.randint(0, 2, (40,), generator=g), bs=8, n_valid=8)

def _fp32_math(o)->bool:
    "Whether output `o` came out of fp32 math (`fp32math`'s autograd functions) rather than the layer's own kernel"
    return o.grad_fn is not None and 'Fp32' in o.grad_fn.name()

class Seen(Callback):
    "At each training batch, what the conv layer computed in (its output's dtype, its weight's) and whether the conv and linear layers ran fp32 math"
    order = 20
    def before_fit(self):
        self.got, self.x = set(), {}
        self.hs = [self.model[i].register_forward_hook(lambda m, a, o, i=i: self.x.__setitem__(i, (o.dtype, m.weight.dtype, _fp32_math(o)))) for i in (0, 5)]
    def after_pred(self):
        if self.training: self.got.add((self.x[0][0], self.x[0][1], self.x[0][2], self.x[5][2]))
    def after_fit(self):
        for h in self.hs: h.remove()

def fit(learn, n=1, lr=1e-2, **kw):
    with learn.no_bar(), learn.no_logging(): learn.fit(n, lr, **kw)
    return learn

@pytest.mark.parametrize('cls,dtype,expected', [
    ('avx2', 'bf16', (torch.bfloat16, True)), ('avx2', 'fp16', (torch.float16, True)),
    ('avx512_bf16', 'bf16', (torch.bfloat16, False)), ('amx', 'bf16', (torch.bfloat16, False)), ('amx', 'fp16', (torch.float16, True))])
def test_fit_runs_the_planned_kernels(cls, dtype, expected):
    "In a fit the model computes in the planned dtype (its params fp32), and its conv and linear layers compute in fp32 exactly when planned"
    learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat(), cbs=(s := Seen())).to_half(dtype)
    with assume_capabilities(cpu_caps(cls)): fit(learn)
    dt, f32 = expected
    assert s.got == {(dt, torch.float32, f32, f32)}, s.got
    assert learn.model_to_half.plan == plan_fit(cpu_caps(cls), dtype, model=learn.model)  # the memory format too
    assert fp32_everywhere(learn) and not any(k in m.__dict__ for m in learn.model.modules() for k in ('forward', '_conv_forward'))

def test_auto_without_fast_kernels_is_plain_fp32_training():
    "On an AVX2-only CPU `to_half('auto')` trains exactly as plain fp32 fastai does: same weights, bit for bit"
    ref = fit(Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()), 2)
    learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat(), cbs=(s := Seen())).to_half('auto')
    with assume_capabilities(cpu_caps('avx2')): fit(learn, 2)
    assert s.got == {(torch.float32, torch.float32, False, False)}
    assert all(torch.equal(a, b) for a, b in zip(params(learn), params(ref)))
    assert learn.model_to_half.plan.kernels == 'fp32' and learn.mixed_precision.skipped == 0

def test_auto_trains_here_and_says_so_once(capsys):
    "On this machine, whatever it is, 'auto' trains a small conv net and says what it chose once a process (for that plan)"
    ModelToHalf._said.clear()
    learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('auto')
    w = params(learn)
    for _ in range(2):
        with learn.no_bar(): learn.fit(1, 1e-2)
    plan = plan_fit(detect('cpu'), 'auto', model=learn.model)
    out = capsys.readouterr().out
    assert out.count("to_half('auto') on cpu:") == 1 and plan.line() in out, out
    said = next(l for l in out.splitlines() if l.startswith("to_half('auto')"))
    assert len(said) <= 200 and 'why: learn.model_to_half.plan' in said, said  # short; the reasons and figures on request
    assert learn.model_to_half.plan == plan and fp32_everywhere(learn)
    assert any(not torch.equal(a, b) for a, b in zip(w, params(learn)))
    fit(Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('auto'))  # another Learner, the same plan: silent
    assert capsys.readouterr().out == ''

def test_native_kernels_on_a_slow_cpu_warn_at_each_fit_with_the_fix():
    with assume_capabilities(cpu_caps('avx2')):
        for _ in range(2):  # two Learners, a warning at each fit
            learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('bf16', fp32_math=False)
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter('default'); fit(learn)
            slow = [w for w in ws if 'slow native kernels' in str(w.message)]
            assert len(slow) == 1 and "to_half('auto')" in str(slow[0].message) and '8-30x' in str(slow[0].message)
            assert slow[0].filename == __file__  # the user's line (`fit` here), not fastai's
        learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('bf16')  # fp32 math: nothing to warn of
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter('always'); fit(learn)
        assert not [w for w in ws if 'slow' in str(w.message)]

def test_slow_kernels_warning_calls_work_as_pasted():
    "Issue 34.6: each call the slow-kernels warning suggests runs on the Learner whose fit warned, and then fits without it"
    import re
    with assume_capabilities(cpu_caps('avx2')):
        for dt in ('bf16', 'fp16'):
            learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half(dt, fp32_math=False)
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter('always'); fit(learn)
            msg = next(str(w.message) for w in ws if 'slow native kernels' in str(w.message))
            calls = re.findall(r"`(learn\.[^`]*)`", msg)
            assert len(calls) == 2, msg
            for c in calls:
                assert eval(c, {'learn': learn}) is learn  # as pasted where the warning came from
                with warnings.catch_warnings(record=True) as ws:
                    warnings.simplefilter('always'); fit(learn)
                assert not [w for w in ws if 'slow' in str(w.message)], c
                assert learn.model_to_half.plan.fast or learn.model_to_half.plan.fp32_math, c

def test_dtype_names_any_case():
    "Issue 34.6: 'AUTO', 'BF16', 'Float16' plan as their lower-case names; an unknown name lists what is accepted, 'auto' too"
    caps = cpu_caps('avx512_bf16')
    for a, b in (('AUTO', 'auto'), ('BF16', 'bf16'), ('Float16', 'fp16')): assert plan_precision(caps, a) == plan_precision(caps, b)
    with pytest.raises(ValueError, match="'bf16', 'bfloat16'.*or 'auto'"): plan_precision(caps, 'fp8')

def test_inference_runs_as_the_fits_validation_unless_only_slow_kernels_would():
    "Outside a fit (validate, get_preds) the fit's dtype where it runs about as fast as fp32 (fast kernels or fp32 math); fp32 where only slow native kernels would"
    for f32, cls, dt in (('auto', 'avx2', torch.bfloat16), ('auto', 'avx512_bf16', torch.bfloat16), (False, 'avx2', torch.float32), (False, 'avx512_bf16', torch.bfloat16)):
        learn = fit(Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat(), cbs=(s := Seen())).to_half('bf16', fp32_math=f32))
        with assume_capabilities(cpu_caps(cls)): learn.validate(cbs=(d := InForward(lambda m: m[0], lambda l, o: o.dtype, valid=True)))
        assert d.seen == {dt}, (f32, cls, d.seen)

def test_the_plan_line_says_what_runs():
    "Issue 56.10: on an AVX2 CPU bf16's line says fp32 math runs (not that slow fallbacks do); fp16's names matmuls too; outside a fit's fp32 is said"
    caps = cpu_caps('avx2')
    bf, fp = plan_precision(caps, 'bf16'), plan_precision(caps, 'fp16')
    assert 'fallbacks' not in bf.describe() and 'compute in fp32, as native bf16 is slow here' in bf.describe(), bf.describe()
    assert 'matmuls' in fp.reason and 'convolution' in fp.reason
    assert "NHWC on avx2: 0.86-0.89x NCHW's speed at 64 px (at 128 px faster: 1.17x)" in prefers_channels_last(caps, plan_precision(caps, 'auto'), 'dense')[1]
    ModelToHalf._said.clear()
    with assume_capabilities(caps), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('bf16', fp32_math=False)
        import io, contextlib
        with contextlib.redirect_stdout(out := io.StringIO()), learn.no_bar(): learn.fit(1, 1e-2)
    assert '`validate`/`get_preds` outside a fit run fp32 (native bf16 is slow here)' in out.getvalue(), out.getvalue()

def test_auto_scale_follows_the_dtype():
    "'auto' loss scaling: static 1 for bf16, dynamic from 2**16 for fp16 (on a GPU of compute capability 7.x)"
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('auto')
    with assume_capabilities(cpu_caps('avx512_bf16')): fit(learn)
    mp = learn.mixed_precision
    assert (mp.loss_scale, mp.scaler.dynamic, mp.state_dict()['dtype']) == (1., False, 'torch.bfloat16')
    learn2 = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16')
    assert (learn2.mixed_precision.loss_scale, learn2.mixed_precision.scaler.dynamic) == (2.**16, True)
    mp2 = MixedPrecision(); mp2.load_state_dict(mp.state_dict())  # a checkpoint says which dtype its scale was for
    assert mp2._scaler_dtype == torch.bfloat16 and mp2.loss_scale == 1.

def test_bad_fp32_math_is_refused():
    with pytest.raises(ValueError, match="fp32_math must be 'auto', True or False"):
        Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16', fp32_math='yes')

def test_the_plan_line_is_short_and_its_own(capsys):
    "Issue 62.8: one line of at most ~200 characters, the dtype, math, layout and masters; only its own dtype's figures; only the model's layers"
    ModelToHalf._said.clear()
    with assume_capabilities(cpu_caps('avx2')):
        learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('fp16')  # an MLP: no convolution
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith('to_half(')]
    assert len(line) == 1 and len(line[0]) <= 200, line
    assert all(w in line[0] for w in ('fp16 storage, fp32 math', 'NCHW', 'masters: fp32')) and 'resnet18' not in line[0], line
    full = repr(learn.model_to_half.plan)  # on request: the reasons and figures
    assert 'linear layers compute in fp32' in full and 'convolutions and linear' not in full and 'resnet18' not in full, full

def test_the_plan_line_starts_after_a_bar_that_is_not_the_fits():
    "Issue 62.9: `get_preds` in a `progress_bar` loop of the user's (as `LMLearner.predict` runs it): the line starts a line of its own"
    import io, contextlib, fastai.callback.progress
    from fastprogress.fastprogress import progress_bar
    ModelToHalf._said.clear()
    learn = Learner(synth_dls(), tiny_model(), loss_func=nn.MSELoss()).to_half('bf16')
    with assume_capabilities(cpu_caps('avx2')), contextlib.redirect_stdout(out := io.StringIO()):
        for _ in progress_bar(range(2), leave=False):
            with learn.no_bar(): learn.get_preds()
    text = out.getvalue()
    assert "]\nto_half('bf16') on cpu: " in text, repr(text)
