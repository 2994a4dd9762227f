import tempfile, sys
from tests.pools import get_pool
from tests import conversion_cases as cc, dist_cases
def check(p, label):
    t = tempfile.mkdtemp()
    p.run(cc.save_random_hf, "tiny-moe", t + "/hf")
    ids = cc.tokens(512)
    ref = p.run(cc.hf_logits, t + "/hf", ids)[0]
    p.run(cc.import_hf, t + "/hf", t + "/m", "tiny-moe", [])
    got = p.run(cc.megatron_logits, "tiny-moe", t + "/m", [], ids)[0]
    ref_main = cc.hf_logits(t + "/hf", ids)
    print(label, (got - ref).abs().max().item(), (got - ref_main).abs().max().item(), (ref - ref_main).abs().max().item(), flush=True)
def main():
    mode = sys.argv[1]
    p = get_pool(1)
    if mode == "actor": p.run(dist_cases.make_actor.__wrapped__ if hasattr(dist_cases.make_actor, "__wrapped__") else dist_cases.param_count, [])
    if mode == "lm": p.run(dist_cases.lm_run, ["train.steps=1", "train.output_dir=/tmp/x1"])
    if mode == "lmck": p.run(dist_cases.lm_run, ["train.steps=1", "train.output_dir=/tmp/x2", "checkpoint.dir=/tmp/x2/ck"])
    check(p, mode)
