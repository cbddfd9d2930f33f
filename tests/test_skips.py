"Nothing silent: a step skipped for a non-finite loss warns, overflow skips of the scale's search stay quiet, counts by cause"
import contextlib, io, warnings, torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai_fp16.all import *
from fastai_fp16.report import scale_text
from helpers import *

class BadBatches(Callback):
    "NaN inputs (bad data) at the given (epoch, batch)es"
    order = 0
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.training and (self.epoch, self.iter) in self.at: self.learn.xb = (self.xb[0] * float('nan'),)

def fit(dtype, cbs, epochs=2, logs=None, **kw):
    "A fit under `no_bar()`; `logs` gets what it printed (the skip summary is text, not a row for `learn.logger`) and logged"
    learn = Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss(), cbs=cbs).to_half(dtype, **kw)
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as ws, contextlib.redirect_stdout(out):
        warnings.simplefilter('always')
        with learn.no_bar():
            if logs is not None: learn.logger = logs.append
            learn.fit(epochs, 1e-2)
    if logs is not None: logs += out.getvalue().splitlines()
    return learn, [str(w.message) for w in ws if 'fastai_fp16: the loss was' in str(w.message)]

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_a_nan_loss_warns_once_a_fit_with_its_batch_and_is_counted_apart(dtype):
    logs = []
    learn, ws = fit(dtype, [BadBatches({(0, 2), (1, 4)})], logs=logs, init_scale=256., dynamic=False)
    mp = learn.mixed_precision
    assert (mp.skipped_bad_loss, mp.skipped_overflow, mp.skipped) == (2, 0, 2)
    assert len(ws) == 1 and 'epoch 0, batch 2' in ws[0]  # once a fit, naming the first
    assert [l for l in logs if 'skipped' in str(l)] == ['fastai_fp16: 2 optimizer steps skipped: 2 on an inf/NaN loss '
                                                        '(left out of train_loss).']  # printed, never a row for the logger
    assert all(torch.isfinite(p).all() for p in learn.model.parameters()) and fp32_everywhere(learn)
    _, ws = fit(dtype, [BadBatches({(0, 1)})], epochs=1, init_scale=256., dynamic=False)
    assert len(ws) == 1 and 'epoch 0, batch 1' in ws[0]  # the next fit says it again

def test_overflow_skips_of_the_scales_search_stay_quiet():
    "Overflow skips before the first clean step (a scale started far too high) are the search: counted apart, nothing said"
    logs = []
    learn, ws = fit('fp16', [], logs=logs, init_scale=2.**24)
    mp = learn.mixed_precision
    assert mp.skipped_overflow >= 3 and mp.skipped_bad_loss == 0 and mp.skipped == mp.skipped_overflow == mp.skipped_search
    assert ws == [] and not any('skipped' in str(l) for l in logs)

class InfGrad(Callback):
    "An inf in the first layer's grad after the backward of the given training batches (a gradient overflow, the loss finite)"
    order = 5  # before MixedPrecision's check (10)
    def __init__(self, at): self.at = at
    def after_backward(self):
        if self.training and (self.epoch, self.iter) in self.at: self.model[0].weight.grad[0, 0] = float('inf')

def test_overflow_before_the_first_growth_is_the_search():
    "A back-off after clean steps, before the scale has grown (gradients that vary from batch to batch): still the search, quiet"
    logs = []
    learn, ws = fit('fp16', [InfGrad({(0, 2), (0, 4)})], logs=logs, epochs=1, init_scale=2.**10)
    mp = learn.mixed_precision
    assert (mp.skipped, mp.skipped_overflow, mp.skipped_search, mp.skipped_bad_loss) == (2, 2, 2, 0) and mp.loss_scale == 2.**8
    assert not any('skipped' in str(l) for l in logs), logs

def test_overflow_beyond_the_search_is_said_with_every_count():
    "After a growth one back-off is the search (the probe above the level); a second before the next growth is news"
    logs = []
    learn, ws = fit('fp16', [InfGrad({(0, 2), (0, 4)})], logs=logs, epochs=1, init_scale=2.**10, growth_interval=2)
    mp = learn.mixed_precision  # steps 0-1 clean: a growth to 2**11; 2 backs off (the probe), 4 again before the next growth
    assert (mp.skipped, mp.skipped_overflow, mp.skipped_search, mp.skipped_bad_loss) == (2, 2, 1, 0)
    assert [l for l in logs if 'skipped' in str(l)] == ["fastai_fp16: 2 optimizer steps skipped: 1 on gradient overflow beyond the "
        f"loss scale's normal search (scale now {scale_text(mp.loss_scale)}), 1 while the loss scale searched, as fp16 does."]
    logs = []
    learn, ws = fit('fp16', [InfGrad({(0, 2), (0, 5)})], logs=logs, epochs=1, init_scale=2.**10, growth_interval=2)
    mp = learn.mixed_precision  # a growth (2 clean steps) between them: each back-off answers one, the search
    assert (mp.skipped, mp.skipped_search) == (2, 2) and not any('skipped' in str(l) for l in logs), logs

def test_a_plain_fp16_fit_prints_what_fp32_prints():
    "Default settings, the loss scale searching from 2**16 down to what the gradients take: the output is fp32's, line for line"
    def out(learn):
        o = io.StringIO()
        with contextlib.redirect_stdout(o), warnings.catch_warnings(), learn.no_bar(): warnings.simplefilter('ignore'); learn.fit(2, 1e-2)
        return [l for l in o.getvalue().splitlines() if not l.startswith('to_half(')], learn  # the plan line aside (once a process)
    dls = dls_from(torch.randn(144, 4), torch.randn(144, 2) * 100)  # large targets: large gradients, overflow at 2**16
    ref, _ = out(Learner(dls, tiny_model(), loss_func=nn.MSELoss()))
    got, learn = out(Learner(dls, tiny_model(), loss_func=nn.MSELoss()).to_half('fp16'))
    assert learn.mixed_precision.skipped_overflow >= 1 and learn.mixed_precision.loss_scale < 2.**16  # it searched
    assert len(got) == len(ref) and not any('fastai_fp16' in l for l in got), got

def test_a_skip_at_the_first_batch_leaves_the_loss_curve_finite():
    "A NaN loss at the fit's first batch (nothing trained yet to put back): the curve's first points take the first trained value"
    for at in ({(0, 0)}, {(0, 0), (0, 1)}, {(0, 0), (1, 0)}):
        learn, _ = fit('bf16', [BadBatches(at)], init_scale=1., dynamic=False)
        rec = learn.recorder
        assert learn.mixed_precision.skipped_bad_loss == len(at)
        assert all(torch.isfinite(torch.as_tensor(v)) for v in rec.losses) and len(rec.losses) == len(rec.lrs), (at, rec.losses)
        assert all(v == v for row in rec.values for v in row[:2]) and rec.losses[0] == rec.losses[len([a for a in at if a[0] == 0])]

def test_the_plan_is_said_once_a_process_before_the_first_batch():
    "`lr_find` first (which logs nothing): the plan line before its first batch; later fits, and more Learners of the same plan, say nothing; another plan is said"
    ModelToHalf._said.clear()
    seen = []
    class First(Callback):
        order = 0
        def before_batch(self): seen.append(capsys_out.getvalue())
    mk = lambda dt='bf16', **kw: Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss(), cbs=First()).to_half(dt, **kw)
    capsys_out = io.StringIO()
    with assume_capabilities(cpu_caps('avx2')), contextlib.redirect_stdout(capsys_out), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn = mk()
        with learn.no_bar():
            learn.lr_find(num_it=5, show_plot=False)
            assert "to_half('bf16') on cpu" in seen[0]  # said before lr_find's first batch
            learn.fit(1, 1e-3); learn.fit(1, 1e-3)
        for _ in range(3):
            with (l := mk()).no_bar(): l.fit(1, 1e-3)  # three Learners, the same plan
        with (l := mk(masters='split', opt_states='bf16')).no_bar(): l.fit(1, 1e-3)  # another plan: its masters named
    out = capsys_out.getvalue()
    lines = [l for l in out.splitlines() if l.startswith('to_half(')]
    assert len(lines) == 2 and lines[0].startswith("to_half('bf16') on cpu: bf16 storage, fp32 math"), lines
    assert lines[1].startswith("to_half('bf16', masters='split', opt_states='bf16') on cpu:") and 'masters: bf16 + low 16 bits' in lines[1]

def test_lr_find_says_nothing_of_its_skips(tmp_path):
    "`lr_find`'s trial steps diverge on purpose: a NaN loss there is neither warned of nor summed up, a `CSVLogger` on (which logs `lr_find`) or not"
    from fastai.callback.progress import CSVLogger
    for cbs in ([], [CSVLogger(fname=str(tmp_path/'log.csv'))]):
        learn = Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss(), cbs=[*cbs, BadBatches({(0, 2)})])
        learn.to_half('fp16', init_scale=256., dynamic=False)
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as ws, contextlib.redirect_stdout(out), learn.no_bar():
            warnings.simplefilter('always')
            learn.lr_find(num_it=5, show_plot=False)
        assert learn.mixed_precision.skipped_bad_loss == 1  # it skipped the NaN batch: quietly
        assert not any('fastai_fp16' in str(w.message) for w in ws) and 'skipped' not in out.getvalue(), out.getvalue()
