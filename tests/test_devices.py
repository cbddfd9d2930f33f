"Issue 54: the plan as data (`device_rules`): each row through injected capabilities, Apple's MPS and Intel's XPU planned, their autocast state entered and restored, and the report of the device fastai trains on"
import contextlib, io, warnings, pytest, torch, torch.nn as nn
from unittest.mock import patch
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai_fp16.all import *
from fastai_fp16.device_rules import device_rules, device_rule
from fastai_fp16.op_policy import autocast_ok, enter_autocast, exit_autocast, autocast_off
from helpers import params, fp32_everywhere
from test_hardware import conv_net, conv_dls, fit

def caps_for(rule):
    "Capabilities that meet `rule`'s conditions (the lowest of each range)"
    w = rule.when
    if rule.device == 'cpu':
        c = w['cpu_class']
        return cpu_caps(c) if c in cpu_classes else Capabilities('cpu', 'a CPU without AVX2')
    if rule.device == 'cuda':
        cc = w['cc'][0] or (6, 1)
        return Capabilities('cuda', 'a GPU', cc=cc, cuda_bf16=w.get('cuda_bf16', cc >= (8, 0)))
    if rule.device == 'mps':
        lo, hi = w['torch_version']
        return mps_caps(lo or (hi[0], hi[1] - 1))
    return xpu_caps(w.get('xpu_bf16', False))

names = {torch.float32: 'fp32', torch.float16: 'fp16', torch.bfloat16: 'bf16'}

@pytest.mark.parametrize('rule', device_rules, ids=lambda r: f"{r.device}-{r.condition}")
def test_each_row_is_what_the_plan_goes_by(rule):
    caps = caps_for(rule)
    assert device_rule(caps) is rule
    auto = plan_precision(caps, 'auto')
    assert names[auto.dtype] == rule.auto and auto.warning is None
    sup = half_support(caps)
    for n in ('bf16', 'fp16'):
        speed = getattr(rule, n)[0]
        assert sup[n][0] == (speed != 'slow'), n
        p = plan_precision(caps, n)
        if speed != 'slow': assert (p.kernels, p.warning) == (n, None), (n, p)
        elif rule.math == 'fp32': assert (p.kernels, p.warning) == (f'{n} storage, fp32 math', None), (n, p)
        else:  # slow native kernels, warned, the fix naming what 'auto' trains in here
            assert p.kernels == n and f"`learn.to_float().to_half('auto')` ({rule.auto} here)" in p.warning, (n, p.warning)
            assert rule.slow[n] in p.warning
    for kind in ('dense', 'depthwise'):
        p = plan_kind(caps, 'auto', kind=kind)
        k = 'fp32' if p.dtype == torch.float32 or p.fp32_math else names[p.dtype]
        want = rule.layout(k, kind)
        assert p.channels_last == (want[0] if want else False), (kind, p.layout)
        if kind in rule.fp32_faster: assert p.dtype == torch.float32 and 'measured slower' in p.reason
    assert rule.source.startswith(('measured', 'read', 'not measured'))

@pytest.mark.parametrize('rule', [r for r in device_rules if r.device == 'cpu'], ids=lambda r: r.condition)
def test_each_cpu_row_trains_as_planned(rule):
    "On every CPU class, a fit of `to_half('auto')` runs the row's plan and trains"
    learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('auto')
    w = params(learn)
    with assume_capabilities(caps_for(rule)): fit(learn)
    assert names[learn.model_to_half.plan.dtype] == rule.auto and fp32_everywhere(learn)
    assert any(not torch.equal(a, b) for a, b in zip(w, params(learn)))

def test_a_device_without_a_row_says_it_is_not_measured_and_how_to_measure():
    caps = Capabilities('hpu', 'a Gaudi')
    p = plan_precision(caps, 'auto')
    assert p.dtype == torch.float32 and "no rule for device type 'hpu': not measured there" in p.reason
    assert '`fastai-fp16 bench --device hpu`' in p.reason
    w = plan_precision(caps, 'fp16').warning  # asked for: it trains in it, and says it is not measured
    assert 'not measured' in w and 'fp32 here' not in w
    assert 'rule: none' in str(precision_report(caps=caps))

def test_mps_auto_plans_fp16_nchw_without_a_warning():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    p = plan_fit(mps_caps((2, 14)), 'auto', model=conv)
    assert (p.dtype, p.fp32_math, p.channels_last, p.warning) == (torch.float16, False, False, None)
    assert 'not measured' in p.reason and "torch.autocast's default on MPS" in p.reason and 'PR #193623' in p.layout
    b = plan_fit(mps_caps((2, 14)), 'bf16', model=conv)  # bf16 on request: as asked, no warning, no fp32 math
    assert (b.kernels, b.warning, b.channels_last) == ('bf16', None, False)
    old = plan_precision(mps_caps((2, 7)), 'auto')  # no AMP kernel on MPS before torch 2.8
    assert old.dtype == torch.float32 and 'PR #150255' in old.reason
    # the scale 'auto' gets for fp16 (on MPS as anywhere): dynamic from 2**16, with fp32 masters
    mp = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('auto').mixed_precision
    assert (mp.loss_scale, mp.scaler.dynamic, mp.master_weights, mp.masters) == (2.**16, True, True, 'fp32')

@pytest.mark.parametrize('caps', [mps_caps((2, 14)), mps_caps((2, 15)), xpu_caps(True), xpu_caps(False)], ids=['mps', 'mps-2.15', 'xpu', 'xpu-no-bf16'])
def test_no_back_to_fp32_advice_on_mps_or_xpu(caps):
    for d in ('fp16', 'bf16'):
        w = plan_precision(caps, d).warning
        assert w is None or ('(fp16 here)' in w and 'fp32' not in w), (d, w)
    assert plan_precision(caps, 'auto').dtype == (torch.bfloat16 if caps.xpu_bf16 else torch.float16)

def test_xpu_bf16_where_native_else_fp16():
    assert plan_precision(xpu_caps(True), 'auto').dtype == torch.bfloat16
    p = plan_precision(xpu_caps(False), 'bf16')  # asked for: trained in, with the warning naming fp16
    assert p.kernels == 'bf16' and '(fp16 here)' in p.warning and 'emulated' in p.warning

def test_master_weights_false_refused_where_torch_has_the_mps_unscale_bug():
    with pytest.raises(ValueError, match=r"master_weights=False on mps.*zeroes them.*PR #184286"):
        check_device(mps_caps((2, 14)), 'fp16', master_weights=False)
    with pytest.raises(ValueError, match="PR #184286"): check_device(mps_caps((2, 14)), 'auto', master_weights=False)  # 'auto' is fp16 there
    check_device(mps_caps((2, 14)), 'bf16', master_weights=False)  # bf16 grads take the package's own unscale
    check_device(mps_caps((2, 14)), 'fp16')  # fp32 masters: fp32 grads, which the kernel unscales right
    check_device(mps_caps((2, 15)), 'fp16', master_weights=False)  # taken to have the fix
    with pytest.raises(ValueError, match="upgrade torch"): check_device(mps_caps((2, 7)), 'fp16')
    check_device(mps_caps((2, 7)), 'auto')  # fp32 there: nothing to refuse

def test_a_rows_refusal_stops_the_fit_before_anything_changes(monkeypatch):
    "Where the fit's device has the bug (a CPU row given it here), `to_half('fp16', master_weights=False)` is refused with the reason"
    rule = device_rule(cpu_caps('avx2'))
    monkeypatch.setattr(rule, 'half_grads', "its unscale kernel is made up to zero fp16 grads")
    learn = Learner(conv_dls(), conv_net(), loss_func=CrossEntropyLossFlat()).to_half('fp16', master_weights=False)
    w = params(learn)
    with assume_capabilities(cpu_caps('avx2')), pytest.raises(ValueError, match="made up to zero fp16 grads"): fit(learn)
    assert all(torch.equal(a, b) for a, b in zip(w, params(learn))) and fp32_everywhere(learn)
    monkeypatch.undo()
    with assume_capabilities(cpu_caps('avx2')): fit(learn)  # the same Learner fits once the reason is gone
    assert any(not torch.equal(a, b) for a, b in zip(w, params(learn)))

@pytest.mark.parametrize('dev', ['mps', 'xpu'])
def test_autocast_state_for_mps_and_xpu_entered_and_restored(dev):
    "torch keeps an autocast state per device type, on a CPU-only build too: the op policy enters and restores it as CUDA's"
    assert autocast_ok(dev)
    before = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
    class Rec(nn.Module):
        def forward(self, x, boom=False):
            self.seen = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            with autocast_off(dev): self.off = torch.is_autocast_enabled(dev)
            self.after_off = torch.is_autocast_enabled(dev)
            if boom: raise RuntimeError('boom')
            return x
    m = Rec()
    def window(*args):  # as a fit's window enters and leaves autocast's state around the forward (`casts`)
        prev = enter_autocast(dev, torch.bfloat16)
        try: return m(*args)
        finally: exit_autocast(dev, prev)
    window(torch.ones(1))
    assert (m.seen, m.off, m.after_off) == ((True, torch.bfloat16), False, True)
    assert (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) == before
    with pytest.raises(RuntimeError, match='boom'): window(torch.ones(1), True)
    assert (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) == before  # put back when the forward raises
    assert torch.is_autocast_enabled('cpu') is False and torch.is_autocast_enabled('cuda') is False  # other devices' untouched

def test_report_and_doctor_are_about_the_device_fastai_trains_on(monkeypatch):
    import fastai.torch_core as tc
    monkeypatch.setattr(tc, 'default_device', lambda use=-1: torch.device('mps'))  # as on a Mac
    assert fastai_device() == torch.device('mps')
    r = precision_report()
    assert r.caps.device_type == 'mps' and r.cpu == detect('cpu') and r.rule is device_rule(r.caps)
    text = str(r)
    assert text.startswith('mps: Apple GPU (MPS') and '\n  beside it, CPU: ' in text and 'rule: mps, torch_version' in text
    assert ('auto: fp16' if r.caps.torch_version >= (2, 8) else 'auto: fp32') in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out): res = doctor(bench=False)
    text = out.getvalue()
    assert 'fastai trains on: mps' in text and 'mps: Apple GPU' in text and 'beside it, CPU: ' in text and 'Recommended: ' in text
    assert 'auto, dense conv nets: fp16, NCHW' in text and res['report'].caps.device_type == 'mps'
    monkeypatch.undo()  # fastai's own: the CPU here (or 'meta' under tools/pretend.py), with no CPU beside it when it is one
    r = precision_report()
    assert r.caps.device_type == tc.default_device().type and (r.cpu is None) == (r.caps.device_type == 'cpu')

def test_xpu_detection_asks_each_gpu_without_emulation():
    "As CUDA's: `is_bf16_supported` answers for the current GPU and counts emulation unless told not to"
    cur, asked = [0], []
    def is_bf16_supported(including_emulation=True):
        asked.append((cur[-1], including_emulation)); return cur[-1] == 1 or including_emulation
    @contextlib.contextmanager
    def device(d): cur.append(torch.device(d).index); yield; cur.pop()
    names = {0: 'Intel Arc A380 (emulated bf16 here)', 1: 'Intel Data Center GPU Max'}
    with patch.multiple(torch.xpu, is_bf16_supported=is_bf16_supported, device=device, current_device=lambda: 0,
                        get_device_name=lambda d: names[d.index]):
        from fastai_fp16.hardware import _detect
        a, b = _detect.__wrapped__('xpu', 0, None), _detect.__wrapped__('xpu', 1, None)
    assert asked == [(0, False), (1, False)] and (a.xpu_bf16, b.xpu_bf16) == (False, True)
    assert (plan_precision(a, 'auto').dtype, plan_precision(b, 'auto').dtype) == (torch.float16, torch.bfloat16)
