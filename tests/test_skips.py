"Nothing silent: a step skipped for a non-finite loss warns, overflow skips of the scale's search stay quiet, counts by cause"
import contextlib, io, warnings, torch, torch.nn as nn, pytest
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai_fp16.all import *
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
    logs = []
    learn, ws = fit('fp16', [], logs=logs, init_scale=2.**24)
    mp = learn.mixed_precision
    assert mp.skipped_overflow >= 3 and mp.skipped_bad_loss == 0 and mp.skipped == mp.skipped_overflow
    assert ws == [] and any(f'{mp.skipped_overflow} on gradient overflow' in str(l) for l in logs)

def test_a_clean_fit_logs_no_skip_line():
    logs = []
    learn, ws = fit('bf16', [], logs=logs)
    assert learn.mixed_precision.skipped == 0 and ws == [] and not any('skipped' in str(l) for l in logs)

def test_the_plan_is_told_at_the_first_fit_that_logs(capsys):
    "`to_half('auto'); lr_find(); fit()`: lr_find runs without logging, so the fit after it says what 'auto' chose"
    learn = Learner(synth_dls(n=128, bs=16), tiny_model(), loss_func=nn.MSELoss()).to_half()
    with learn.no_bar():
        learn.lr_find(num_it=5, show_plot=False)
        before = capsys.readouterr().out
        learn.fit(1, 1e-3); learn.fit(1, 1e-3)
    out = capsys.readouterr().out
    assert "to_half('auto') on cpu" not in before and out.count("to_half('auto') on cpu") == 1, (before, out)
