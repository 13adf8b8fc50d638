"""`tfdist plan`: for a model and a cluster, which parallel layout fits in memory, and which is
fastest.

Read top to bottom: model.py (devices, models, layouts, memory per device, time per step, the
search), published.py (the devices' datasheets, the published models and runs, the calibration),
machine.py (this machine's benches), benchmarks.py (every committed bench row predicted) and
report.py (the table, the chart and the command that runs a plan). The command line is
tfdist/cli/plan.py; its docstring is the overview that `tfdist plan --help` prints. The
transformer's arithmetic (parameters, FLOPs, activation and model-state bytes) is
tfdist.models.arithmetic's, which the GPT and the pipeline use too. This package re-exports their
public names.

    from tfdist import plan
    m = plan.MODELS["gpt3-175b"]
    best = plan.search(m, plan.Cluster(plan.DEVICES["a100-80gb"], 1024), batch=1536)[0]
    print(best.layout, best.tflops_per_device)
"""
from tfdist.parallel.layout import Layout  # noqa: F401  (the class the planner prices)
from tfdist.plan.benchmarks import measured  # noqa: F401
from tfdist.plan.machine import (  # noqa: F401
    BENCH_HINT,
    allreduce_bandwidth,
    cpu_device,
    read_bench,
)
from tfdist.plan.model import (  # noqa: F401
    GB,
    STATE_BYTES,
    Cluster,
    Device,
    Model,
    Options,
    Plan,
    activation_bytes_per_layer,
    allreduce_seconds,
    config_of,
    evaluate,
    layouts,
    memory,
    model_from_config,
    planned,
    search,
    stage_params,
    step_time,
)
from tfdist.plan.published import (  # noqa: F401
    CPU,
    DEVICES,
    MEGATRON_OPTIONS,
    MODELS,
    PUBLISHED,
    MiB,
    calibrated,
    calibrated_options,
    fit_efficiency,
    validate,
    zero_figure1,
)
from tfdist.plan.report import (  # noqa: F401
    base_config,
    chart,
    format_table,
    load_config,
    refusal,
    report,
    runnable,
    strategy_command,
    tfdist_command,
)
