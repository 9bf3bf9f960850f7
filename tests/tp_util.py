"""Shared by the tensor-parallel tests: bad plans and sizes must be refused by name, before anything changes."""
from zerolab.parallel import tensor_parallel


def conversion_errors(cases, mesh):
    """Inside a rank: for each (build, plan, sequence_parallel), the ValueError ``tensor_parallel`` raised
    (None if it raised none) and whether the model's modules were left as they were."""
    errors = []
    for build, plan, sp in cases:
        model = build()
        before = [(n, type(m)) for n, m in model.named_modules()]
        try:
            tensor_parallel(model, mesh, plan, sequence_parallel=sp)
            errors.append(None)
        except ValueError as e:
            errors.append((str(e), [(n, type(m)) for n, m in model.named_modules()] == before))
    return errors


def assert_named(errors, wants):
    """Every case refused, its message naming the problem, the model unchanged."""
    assert len(errors) == len(wants)
    for got, want in zip(errors, wants):
        assert got is not None and want in got[0], (want, got)
        assert got[1], f"the model was changed before the error: {want}"
