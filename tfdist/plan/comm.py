"""The data-parallel gradients' routes across hosts, priced: the bytes each host's link carries a
step, and their seconds at the link's rate, for every route of `config.dp` (the flat ring, the
hierarchy, bf16, PowerSGD, islands), and which one to take when the link is slow.

H hosts of L workers each (N = H x L), S bytes of float32 gradients, P parameters:

    flat          a ring in host order crosses each host's link once each way, with every
                  worker's 2(N-1)/N x S (interleaved workers: L times that)
    hierarchy     2(H-1)/H x S: the least for every host to hold the sum
    bf16          an all-to-all of bf16 pieces (L(N-L)/N x S/2 out of a host) and a ring
                  all-gather of the sums ((N-1)/N x S/2 on the crossing hop)
    powersgd      the ring's 2(N-1)/N x the floats PowerSGD sends: (rows + rest) x r of every
                  matrix it compresses, the rest whole (tfdist.parallel.dp.compression's rule)
    islands       every `sync_every` updates each island's delta to the exchange and the mean to
                  each of its workers (int8: P bytes and a scale per 4096; bf16: 2P; float32:
                  4P); the exchange on the first host, each island on a host of its own

These are the bytes `tools/bench/links.py` counts at the links (bench_results/links-*.json).

Example (gpt_mini, 2 hosts of 2 workers: MB out of the busiest host a step):

    >>> from tfdist.plan import comm, load_config, model_from_config
    >>> m = model_from_config(load_config("configs/gpt_mini.py"), "gpt_mini")
    >>> routes = comm.routes(m, hosts=2, per_host=2)
    >>> {k: round(v / 1e6, 1) for k, v in routes.items()}
    {'flat': 65.1, 'hierarchy': 43.4, 'bf16': 38.0, 'powersgd': 1.1, 'islands': 0.4}
"""
from tfdist.parallel.dp import compression, exchange

ROUTES = ("flat", "hierarchy", "bf16", "powersgd", "islands")


def matrices(model):
    """The shapes of `model`'s weight matrices as tfdist's GPT holds them (`arithmetic.
    Transformer`'s sizes), and the count of its other (vector) parameters."""
    h, f, kv = model.n_embd, model.ffn_width, model.kv
    layer = [(h, h + 2 * kv), (h, h), (h, f * (2 if model.gated_mlp else 1)), (f, h)]
    shapes = layer * model.n_layer + [(model.vocab_size, h)]
    if not model.tied_embeddings:
        shapes.append((h, model.vocab_size))
    if model.learned_positions:
        shapes.append((model.seq_len, h))
    vectors = model.params - sum(a * b for a, b in shapes)
    return shapes, vectors


def powersgd_floats(model, rank):
    """The floats PowerSGD rank `rank` all-reduces a step (P and Q of each matrix it compresses,
    the rest whole)."""
    shapes, vectors = matrices(model)
    sent = vectors
    for rows, rest in shapes:
        squeezes = rows * rest >= compression.MIN_COMPRESSION_RATE * (rows + rest) * rank
        sent += (rows + rest) * rank if squeezes else rows * rest
    return sent


def routes(model, hosts, per_host, rank=4, sync_every=50, exchange_as="int8", order="hosts"):
    """{route: bytes out of the busiest host's link a step} for `hosts` hosts of `per_host`
    workers (`order`: "hosts", workers a a b b, or "interleaved", a b a b: the flat ring's)."""
    n, s, p = hosts * per_host, 4 * model.params, model.params
    crossings = per_host if order == "interleaved" else 1
    ring = 2 * (n - 1) / n
    delta = exchange.encoded_size(p, exchange_as)
    return {
        "flat": crossings * ring * s,
        "hierarchy": 2 * (hosts - 1) / hosts * s,
        "bf16": per_host * (n - per_host) / n * s / 2 + (n - 1) / n * s / 2,
        "powersgd": ring * 4 * powersgd_floats(model, rank),
        "islands": max((hosts - 1) * per_host * delta, delta) / sync_every,
    }


def seconds(bytes_per_step, link_bytes_per_s):
    """{route: seconds a step on a link of `link_bytes_per_s` (one way)}."""
    return {k: v / link_bytes_per_s for k, v in bytes_per_step.items()}


def step_seconds(compute_seconds, bytes_per_step, link_bytes_per_s):
    """{route: seconds a step}: `compute_seconds` (the step without its link) and the route's
    bytes at the link's rate after it (nothing hidden: on a slow link the overlap hides little,
    docs/benchmarks.md "Why 70 %")."""
    return {k: compute_seconds + t for k, t in seconds(bytes_per_step, link_bytes_per_s).items()}


def recommend(model, hosts, per_host, link_bytes_per_s, compute_seconds, **options):
    """(route, one line why) for a job whose step computes for `compute_seconds`: the flat ring
    when the link hides it (it costs under a tenth of the compute), else the cheapest route that
    keeps every update synchronous (hierarchy, bf16, PowerSGD), else islands."""
    cost = seconds(routes(model, hosts, per_host, **options), link_bytes_per_s)
    rate = f"{link_bytes_per_s * 8 / 1e9:g} Gbit/s"
    if cost["flat"] <= 0.1 * compute_seconds:
        return "flat", (f"the flat ring's {cost['flat']:.2f} s a step at {rate} is under a "
                        f"tenth of the {compute_seconds:.2f} s of compute")
    synchronous = [r for r in ("hierarchy", "bf16", "powersgd")
                   if per_host > 1 or r != "hierarchy"]
    best = min(synchronous, key=cost.get)
    if cost[best] <= 0.1 * compute_seconds or cost[best] <= cost["islands"]:
        return best, (f"the flat ring takes {cost['flat']:.2f} s a step at {rate} against "
                      f"{compute_seconds:.2f} s of compute; {best} takes {cost[best]:.2f} s")
    return "islands", (f"at {rate} even {best} takes {cost[best]:.2f} s a step against "
                       f"{compute_seconds:.2f} s of compute; islands take {cost['islands']:.3f} s "
                       f"(a sync every {options.get('sync_every', 50)} updates)")


def describe(model, cluster, plan):
    """Lines for `tfdist plan`: where `plan`'s data-parallel replicas span nodes, each route's
    bytes and seconds a step on a node's link (its devices' share of the network, together), and
    the route to take."""
    layout = plan.layout
    node = cluster.node()
    if layout.tp * layout.pp > 1 or layout.dp <= node or layout.dp % node:
        return []  # (data parallelism alone, across whole nodes: the routes priced here)
    hosts, link = layout.dp // node, (cluster.inter_bw or cluster.device.inter_bw) * node
    if layout.zero:
        return [f"gradients across {hosts} nodes: ZeRO-{layout.zero} reduce-scatters them on "
                f"its own collectives (config.dp's routes are for plain data parallelism: "
                f"--zero=0 to price them)"]
    cost = routes(model, hosts, node)
    compute = plan.time["compute"]
    route, why = recommend(model, hosts, node, link, compute)
    lines = [f"gradients across {hosts} nodes of {node} (a node's link "
             f"{link * 8 / 1e9:g} Gbit/s one way; config.dp):"]
    for name in ROUTES:
        lines.append(f"  {name:10s} {cost[name] / 1e6:10.1f} MB a step out of a node, "
                     f"{cost[name] / link:8.3f} s")
    option = {"flat": "", "hierarchy": "--config.dp.hierarchy=host",
              "bf16": "--config.dp.compression=bf16",
              "powersgd": "--config.dp.compression=powersgd --config.dp.powersgd_rank=4",
              "islands": f"tfdist launch --islands={hosts} ... --config.dp.islands={hosts}"}[route]
    lines.append(f"  recommended: {route}{f' ({option})' if option else ''}: {why}")
    return lines
