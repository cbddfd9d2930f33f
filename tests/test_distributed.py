"Two CPU processes on gloo, under torchrun, seeded apart: ranks end bit-identical and skip together, a `PrecisionMonitor` on each"
import signal, subprocess, sys, os, tempfile, time, warnings, torch, pytest, numpy as np, pandas as pd
from pathlib import Path

def _launch(out, dtype, port, masters, limit):
    "(torchrun's exit code, its output); the code is None where it hung, and the output holds each process's Python stacks"
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'ACCELERATE_USE_CPU': '1', 'PYTHONFAULTHANDLER': '1'}  # accelerate: gloo on CPU
    args = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(port),
            str(Path(__file__).parent/'dist_train.py'), str(out), dtype, masters]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try: log = p.communicate(timeout=limit)[0]; return p.returncode, log
    except subprocess.TimeoutExpired: pass
    import psutil  # accelerate's
    procs = psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]  # torchrun starts its workers in sessions of their own
    for sig in (signal.SIGABRT, signal.SIGKILL):  # faulthandler: each prints its threads' stacks; then all end, their port free again
        for q in procs:
            try: q.send_signal(sig)
            except psutil.NoSuchProcess: pass
        time.sleep(3)
    return None, p.communicate()[0]

def _run(dtype, port, masters='fp32'):
    pytest.importorskip('accelerate')
    out = Path(tempfile.mkdtemp())
    rc, log = _launch(out, dtype, port, masters, 240)  # ~10 s on 2 cores
    if rc is None:  # seen once in CI (gloo, 2 processes on 2 cores); ran 55 times clean here: once more, and say so
        warnings.warn(f"dist_train.py {dtype} {masters} hung for 240 s; run again. The processes' stacks:\n{log[-6000:]}")
        out = Path(tempfile.mkdtemp())
        rc, log = _launch(out, dtype, port + 100, masters, 240)
    assert rc == 0, log[-6000:]
    return [torch.load(out/f'rank{i}.pt', weights_only=False) for i in (0, 1)]

@pytest.mark.parametrize('dtype,port', [('fp16', 29533), ('bf16', 29534)])
def test_ranks_seeded_apart_end_identical(dtype, port):
    a, b = _run(dtype, port)
    assert a['skipped'] == b['skipped'] == 2   # batch 2 of each epoch: rank 0 saw no NaN, yet skipped with rank 1
    assert a['scale'] == b['scale'] and a['scales'] == b['scales']
    assert a['dtypes'] == b['dtypes'] == {torch.float32}
    half = torch.float16 if dtype == 'fp16' else torch.bfloat16
    assert a['reduced'] == b['reduced'] == {half, torch.float32}  # the grad buckets travel half (the fp32: our overflow flag)
    for x, y in zip(a['params'], b['params']): assert torch.equal(x, y)  # rank 0's masters on both ranks, bit for bit
    for x, y in zip(a['opt'], b['opt']): assert torch.equal(x, y)
    # the monitor (fp16: on the Learner, before DDP wraps the model; bf16: given to `fit`, after) names the layers alike
    for r in (a, b):
        assert [o['step'] for o in r['overflows']] == [2, 5]  # batch 2 of each epoch, on rank 0 too: DDP all-reduced the NaN
        assert all(o['layers'] == ['0', '1', '3'] and o['start'] == '3' for o in r['overflows'])
        df = pd.DataFrame(r['records'])
        assert set(df.layer) == {'0', '1', '3'} and sorted(set(df.step)) == [0, 2, 3, 5]  # every 3rd step, and the overflows
        assert (df[df.step.isin([2, 5])].n_nan > 0).all() and (df[~df.step.isin([2, 5])].n_nan == 0).all()
        assert r['metric_names'][3:5] == ['loss_scale', 'skipped'] and [v[3] for v in r['values']] == [1, 2]
    assert pd.DataFrame(a['records']).equals(pd.DataFrame(b['records']))  # the same records on both ranks (NaN as NaN)
    np.testing.assert_array_equal(np.array(a['values'], dtype=float), np.array(b['values'], dtype=float))

@pytest.mark.parametrize('masters,port', [('split', 29541), ('kahan', 29542), ('stochastic', 29543)])
def test_lean_masters_ranks_end_identical(masters, port):
    "Lean masters: DDP broadcasts rank 0's bf16 params, the first batch its low bits or compensation; stochastic rounding draws alike; a pruning callback's writes land alike"
    a, b = _run('bf16', port, masters)
    assert a['pruned'] is True and b['pruned'] is True  # every pruned weight exactly 0 on both ranks (split before issue 48: NaN)
    assert a['skipped'] == b['skipped'] == 2  # the NaN on rank 1 skipped the step on both
    assert a['dtypes'] == b['dtypes'] == {torch.float32}  # fp32 after the fit
    assert a['reduced'] == b['reduced'] == {torch.bfloat16, torch.float32}
    for x, y in zip(a['params'], b['params']): assert torch.equal(x, y)  # one fp32 value on both ranks, bit for bit
    for x, y in zip(a['opt'], b['opt']): assert torch.equal(x, y)
    ck = torch.load(next(Path(a['path']).glob('models/ep0.pth')), weights_only=False)  # saved mid-fit by rank 0
    assert all(t.dtype == torch.float32 for t in ck['model'].values() if t.is_floating_point())
