"""gpu_check.sh's lean stage: resnet50 under `to_half('bf16')` and `to_half('bf16', masters=...)`, step ms and the torch ops
(on CUDA also the kernels) from the end of the backward to the end of the step; then a lean fit of a model with a
checkpointed block and an autocast-off region (gpu-audit-s10 row 2). Prints markdown; exit 1 if a fit raised.

    python tools/gpu_lean.py --device cuda [--arch resnet50 --size 224 --bs 64 --steps 20 --warmup 5]"""
import argparse, collections, statistics, sys, time, traceback
import torch, torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastai.callback.core import Callback
from fastai.callback.channelslast import ChannelsLast
import fastai.callback.progress
import fastai_fp16.learner
from fastai_fp16.tools.bench_overhead import SynthDL, SkipValid

class Ops(TorchDispatchMode):
    "Counts the torch ops dispatched, and those that read a value to the host (`.item()`, a tensor taken as a number)"
    def __init__(self): super().__init__(); self.n = self.reads = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1; self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))

class StepProbe(Callback):
    "Per training step: wall ms (synchronized), and at the last one the torch ops (and CUDA kernels) from after_backward to after_step"
    order = 1000
    def before_fit(self): self.ms, self.ops, self.reads, self.kernels, self.t = [], None, None, None, None
    def _sync(self):
        if self.dls.device is not None and torch.device(self.dls.device).type == 'cuda': torch.cuda.synchronize()
    def before_batch(self): self._sync(); self.t = time.perf_counter()
    def after_backward(self):
        if self.iter != self.n_iter - 1: return
        self.mode = Ops(); self.mode.__enter__()
        self.prof = None
        if torch.device(self.dls.device).type == 'cuda':
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]); self.prof.__enter__()
    def after_step(self):
        if self.iter != self.n_iter - 1: return
        self.mode.__exit__(None, None, None); self.ops, self.reads = self.mode.n, self.mode.reads
        if self.prof is not None:
            self._sync(); self.prof.__exit__(None, None, None)
            self.kernels = sum(e.count for e in self.prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    def after_batch(self):
        if self.training: self._sync(); self.ms.append((time.perf_counter() - self.t) * 1e3)

def fit(arch, size, bs, steps, warmup, device, **kw):
    import torchvision
    torch.manual_seed(0)
    m = getattr(torchvision.models, arch)(num_classes=10)
    g = torch.Generator().manual_seed(0)
    xy = (torch.randn(bs, 3, size, size, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device))
    dls = DataLoaders(SynthDL([xy], warmup + steps), SynthDL([], 0), device=device)
    learn = Learner(dls, m, loss_func=nn.CrossEntropyLoss(), cbs=[SkipValid(), ChannelsLast(), StepProbe()]).to_half('bf16', **kw)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    p = learn.step_probe
    return statistics.median(p.ms[warmup:]), p.ops, p.reads, p.kernels

class Ckpt(nn.Module):
    "A block recomputed in the backward (non-reentrant checkpoint) with an autocast-off region inside"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
    def block(self, x):
        with torch.autocast(x.device.type, enabled=False): x = self.a(x.float()).relu()
        return self.b(x)
    def forward(self, x): return checkpoint(self.block, x, use_reentrant=False)

def ckpt_fit(device, masters):
    from fastai_fp16.core import synth_dls
    torch.manual_seed(0)
    learn = Learner(synth_dls(n=64, n_in=8, n_out=8, device=device), nn.Sequential(nn.Linear(8, 8), Ckpt()).to(device),
                    loss_func=nn.MSELoss()).to_half('bf16', masters=masters)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    return learn.recorder.values[-1][0]

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    for k,v in dict(device='cuda', arch='resnet50', size=224, bs=64, steps=20, warmup=5, masters='split,kahan,stochastic').items():
        ap.add_argument(f'--{k}', type=type(v), default=v)
    a = ap.parse_args()
    rc, rows = 0, []
    for ms in ['fp32'] + a.masters.split(','):
        try:
            ms_, ops, reads, ks = fit(a.arch, a.size, a.bs, a.steps, a.warmup, a.device, masters=ms)
            rows.append(f"| {ms} | {ms_:.1f} | {ops} | {reads} | {'-' if ks is None else ks} |")
        except Exception as e: rc = 1; rows.append(f"| {ms} | raised {type(e).__name__}: {str(e)[:120]} | | | |"); traceback.print_exc()
    print(f"{a.arch} {a.size}px bs {a.bs}, channels_last, to_half('bf16', masters=...) on {a.device}: median train step ms of {a.steps} "
          f"after {a.warmup}; torch ops, host reads among them (0: the skip decided on the device) and CUDA kernels from the end of the backward to the end of the last step\n")
    print('| masters | step ms | ops | host reads | kernels |\n|---|---|---|---|---|\n' + '\n'.join(rows) + '\n')
    for ms in a.masters.split(','):
        try: print(f"checkpointed block with an autocast-off region, masters={ms!r}: trained, loss {ckpt_fit(a.device, ms):.4f}")
        except Exception as e: rc = 1; print(f"checkpointed block with an autocast-off region, masters={ms!r}: raised {type(e).__name__}: {str(e)[:200]}")
    sys.exit(rc)
