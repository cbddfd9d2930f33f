"`to_half(channels_last=None)`: fastai's ChannelsLast where the fit's plan says NHWC is faster, capabilities injected"
import torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastai.callback.core import Callback
from fastai.callback.channelslast import ChannelsLast
from fastai_fp16.all import *
from fastai_fp16.device_rules import device_rules, device_rule
from helpers import *

def img_dls(n=32, bs=8, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randn(n, 2, generator=g)
    return DataLoaders.from_dsets(list(zip(x[:24], y[:24])), list(zip(x[24:], y[24:])), bs=bs, device='cpu')

def dense_net(): torch.manual_seed(0); return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
def depthwise_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2))
def mlp(): torch.manual_seed(0); return nn.Sequential(nn.Flatten(), nn.Linear(3*8*8, 2))

class Layout(Callback):
    "What the fit ran in: the first conv weight's memory format at each step"
    order = 20
    def before_step(self):
        w = next((p for p in self.model.parameters() if p.dim() == 4 and p.shape[1] > 1 and p.shape[-1] > 1), None)
        self.cl = None if w is None else w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()

@pytest.fixture
def measured(monkeypatch):
    "A CPU class where NHWC was measured faster for dense fp32 conv nets and slower for depthwise ones"
    nhwc = device_rule(cpu_caps('avx2')).nhwc  # the row the plan reads
    monkeypatch.setitem(nhwc, ('fp32', 'dense'), (True, 'measured faster NHWC on avx2: made up'))
    monkeypatch.setitem(nhwc, ('fp32', 'depthwise'), (False, 'measured slower NHWC on avx2: made up'))
    return cpu_caps('avx2')

def fit(learn, caps):
    with assume_capabilities(caps), learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    return learn

@pytest.mark.parametrize('net,expected', [(dense_net, True), (depthwise_net, False), (mlp, None)])
def test_auto_layout_follows_the_plan(measured, net, expected):
    learn = fit(Learner(img_dls(), net(), loss_func=nn.MSELoss(), cbs=(lay := Layout())).to_half('auto'), measured)
    assert lay.cl == expected
    p = learn.model_to_half.plan
    assert p.channels_last == bool(expected) and ('measured' in p.layout or 'no 2d convolutions' in p.layout)
    assert ('channels_last' if expected else 'NCHW') in p.describe() and fp32_everywhere(learn)
    assert len([cb for cb in learn.cbs if isinstance(cb, AutoChannelsLast)]) == 1  # to_half's one, deciding
    learn.to_float()
    assert not [cb for cb in learn.cbs if isinstance(cb, AutoChannelsLast)]

def test_auto_layout_says_so_when_it_picks_channels_last(measured, capsys):
    learn = Learner(img_dls(), dense_net(), loss_func=nn.MSELoss()).to_half('bf16')  # fp32 math on this class
    with assume_capabilities(measured), learn.no_bar(): learn.fit(1, 1e-2)
    out = capsys.readouterr().out
    assert "to_half('bf16') on cpu" in out and 'channels_last (faster here)' in out, out
    assert 'made up' in repr(learn.model_to_half.plan)  # the figures behind it, on request

def test_explicit_false_is_respected(measured):
    learn = fit(Learner(img_dls(), dense_net(), loss_func=nn.MSELoss(), cbs=(lay := Layout())).to_half('auto', channels_last=False), measured)
    assert lay.cl is False and learn.model_to_half.plan.channels_last is False
    assert not [cb for cb in learn.cbs if isinstance(cb, ChannelsLast)]

def lazy_net(): torch.manual_seed(0); return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))

@pytest.mark.parametrize('channels_last', [None, True, False])
def test_lazy_layers_train_whatever_the_layout(channels_last):
    "A lazy layer is made before the layout is set (issue 62.4): on a CPU class where 'auto' picks channels_last, injected"
    caps = cpu_caps('avx512_bf16')  # bf16, NHWC for dense conv nets
    learn = Learner(img_dls(), lazy_net(), loss_func=nn.MSELoss(), cbs=(lay := Layout())).to_half(channels_last=channels_last)
    state = torch.get_rng_state()
    fit(learn, caps)
    assert lay.cl is (channels_last is not False) and learn.model[3].weight.shape == (2, 4*6*6) and fp32_everywhere(learn)
    plain = Learner(img_dls(), lazy_net(), loss_func=nn.MSELoss())
    torch.set_rng_state(state)
    with plain.no_bar(), plain.no_logging(): plain.fit(1, 1e-2)  # plain fastai trains it too

def test_channels_last_takes_true_false_or_none():
    learn = Learner(img_dls(), dense_net(), loss_func=nn.MSELoss())
    for bad in ('yes', 'auto', 2):
        with pytest.raises(ValueError, match=r"channels_last must be True, False or None"): learn.to_half('bf16', channels_last=bad)
    assert not [cb for cb in learn.cbs if isinstance(cb, (AutoChannelsLast, ModelToHalf))]  # left as it was

@pytest.mark.parametrize('arg', [None, True])
def test_users_own_channels_last_is_kept_and_not_doubled(arg):
    "Where NHWC is not preferred (a depthwise net), the user's ChannelsLast still puts the fit in channels_last"
    learn = Learner(img_dls(), depthwise_net(), loss_func=nn.MSELoss(), cbs=[ChannelsLast(), lay := Layout()]).to_half('auto', channels_last=arg)
    fit(learn, cpu_caps('avx2'))
    assert lay.cl is True and learn.model_to_half.plan.channels_last is True
    assert [type(cb) for cb in learn.cbs if isinstance(cb, ChannelsLast)] == [ChannelsLast]
    learn.to_float()
    assert [type(cb) for cb in learn.cbs if isinstance(cb, ChannelsLast)] == [ChannelsLast]  # the user's stays

def test_not_measured_stays_nchw():
    "A class or kind nobody measured: NCHW, and the plan says why"
    p = plan_fit(cpu_caps('arm_bf16'), 'auto', model=dense_net())
    assert p.channels_last is False and 'not measured' in p.layout

def test_measured_table_is_what_the_plan_goes_by():
    for rule in (r for r in device_rules if r.device == 'cpu' and r.when['cpu_class'] in cpu_classes):
        cls = rule.when['cpu_class']
        for (k, kind), fast in rule.nhwc.items():
            plan = plan_precision(cpu_caps(cls), 'bf16', fp32_math=k == 'fp32')  # convolutions in fp32 (fp32 math) or bf16
            assert prefers_channels_last(cpu_caps(cls), plan, kind)[0] == fast[0], (cls, k, kind)
