"Small models, data and spy callbacks shared by the tests"
import sys, torch, torch.nn as nn
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastai.callback.core import Callback
from fastai_fp16.all import *

def dls_from(x, y, bs=16, n_valid=16):
    ds = list(zip(x, y))
    return DataLoaders.from_dsets(ds[:-n_valid], ds[-n_valid:], bs=bs, shuffle=False, device='cpu')

def params(learn): return [p.detach().clone() for p in learn.model.parameters()]

def fp32_everywhere(learn):
    return {t.dtype for t in list(learn.model.parameters()) + list(learn.model.buffers()) if t.is_floating_point()} == {torch.float32}

def opt_on_model(learn):
    return [id(p) for p in learn.opt.all_params().itemgot(0)] == [id(p) for p in learn.model.parameters()]

class SyncCount(Callback):
    "Counts the host syncs made from fastai_fp16's code (`.item()`, `.tolist()`, `bool()` of a tensor, `torch.equal`) and the steps"
    def before_fit(self):
        self.n, self.steps = 0, 0
        self.orig = {(o,k): getattr(o, k) for o,ks in ((torch.Tensor, ('item', 'tolist', '__bool__')), (torch, ('equal',))) for k in ks}
        def counting(f):
            def g(t, *a, **k):
                if sys._getframe(1).f_globals.get('__name__', '').startswith('fastai_fp16'): self.n += 1
                return f(t, *a, **k)
            return g
        for (o,k),f in self.orig.items(): setattr(o, k, counting(f))
    def after_step(self): self.steps += 1
    def after_fit(self):
        for (o,k),f in self.orig.items(): setattr(o, k, f)

class StepSpy(Callback):
    "Records, per training batch, whether the optimizer step ran and the master grads' global norm before it"
    order = 15  # after MixedPrecision.before_step, before the step
    def before_fit(self): self.norms, self.steps, self.batches = [], 0, 0
    def before_batch(self):
        if self.training: self.batches += 1
    def before_step(self):
        gs = [p.grad for p in self.opt.all_params(with_grad=True).itemgot(0)]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in gs])).item())
        self.steps += 1

class Item:
    "Picklable transform: index -> row of `t` (for DataLoaders that `learn.export` can save)"
    def __init__(self, t): self.t = t
    def __call__(self, i): return self.t[i]

def exportable_dls(n=64, bs=16, seed=0):
    from fastai.data.core import Datasets
    from fastai.data.transforms import IndexSplitter
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g); y = x @ torch.randn(4, 2, generator=g)
    dsets = Datasets(list(range(n)), [[Item(x)], [Item(y)]], splits=IndexSplitter(list(range(n*3//4, n)))(range(n)))
    return dsets.dataloaders(bs=bs, shuffle=False, device='cpu')

def recipe_by_hand(opt_cls, steps, lr=1e-2, N=64, D_in=32, D_out=16):
    """NVIDIA's recipe written out (fp16 Linear in fp32 math, fp32 masters stepped by `opt_cls`, static scale 128):
    (a fresh fp32 Linear holding the same start, the data, the masters after `steps`)"""
    x, y = torch.randn(N, D_in).half().float(), torch.randn(N, D_out).half().float()
    lin = nn.Linear(D_in, D_out)
    with torch.no_grad():
        for p in lin.parameters(): p.copy_(p.half().float())  # so both start from the same masters
    ref = nn.Linear(D_in, D_out).half(); ref.load_state_dict(lin.state_dict())
    patch_fp32_math(ref)  # fp16 storage, fp32 math: what `to_half` runs on a CPU (fp16 has no fast CPU kernels)
    model_params, master_params = prep_param_lists(ref)
    opt = opt_cls(master_params, lr=lr)
    for _ in range(steps):
        loss = nn.functional.mse_loss(ref(x.half()).float(), y)
        ref.zero_grad()
        (loss*128.).backward()
        model_grads_to_master_grads(model_params, master_params)
        for p in master_params: p.grad.mul_(1./128)
        opt.step()
        master_params_to_model_params(model_params, master_params)
    return lin, x, y, master_params

def moved_alike(a, b, w0, tol=0.2):
    "The params of `a` moved from `w0` as those of `b` did: the size of each move within `tol`, in the same direction"
    for x, y, s in zip(a, b, w0):
        d, r = x - s, y - s
        n, nr = torch.linalg.vector_norm(d), torch.linalg.vector_norm(r)
        if nr < 1e-6: assert n < 1e-4, (n, nr); continue  # a param fp32 barely moved (BatchNorm's at these lrs)
        assert abs(n / nr - 1) < tol and torch.linalg.vector_norm(d - r) < tol * nr, (n, nr)

class InForward(Callback):
    "`f(learn, out)` read as the forward of `mod(learn.model)` ends (`out`: what it computed; its params are the model's fp32 ones throughout), at training batches (`valid`: all); the results in `seen`"
    order = 20
    def __init__(self, mod, f, valid=False): self.mod, self.f, self.valid = mod, f, valid
    def before_fit(self):
        self.seen = set()
        self.h = self.mod(self.learn.model).register_forward_hook(lambda m, a, o: self._see(o))
    def _see(self, out):
        if self.training or self.valid: self.seen.add(self.f(self.learn, out))
    def after_fit(self): self.h.remove()

def pickled_modules(data:bytes)->set:
    "The modules a pickle refers to (its GLOBAL and STACK_GLOBAL opcodes), read from its opcodes, not searched for in its bytes"
    import pickletools
    mods, pushed, memo = set(), [None, None], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name == 'GLOBAL': mods.add(arg.split(' ')[0]); pushed.append(None)
        elif op.name == 'STACK_GLOBAL': mods.add(pushed[-2]); pushed.append(None)
        elif op.name in ('MEMOIZE', 'PUT', 'BINPUT', 'LONG_BINPUT'): memo[len(memo) if op.name == 'MEMOIZE' else arg] = pushed[-1]
        elif op.name in ('GET', 'BINGET', 'LONG_BINGET'): pushed.append(memo.get(arg))
        elif op.stack_after: pushed.append(arg if isinstance(arg, str) and op.stack_after[0].name in ('str', 'unicode', 'string') else None)
    return mods

def exported_modules(fn)->set:
    "The modules a `learn.export` file refers to: those of the pickle in its zip (a path in it naming a folder is no reference)"
    import zipfile
    with zipfile.ZipFile(fn) as z: return set().union(*(pickled_modules(z.read(n)) for n in z.namelist() if n.endswith('.pkl')))
