"""Server DiSK through the Flower apps: one combined vector per client, one clip, one draw."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch.nn.utils import parameters_to_vector

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.records import model_to_record, record_to_update
from fedprivacy.optim.disk import disk_coefficient
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _final(cfg):
    return torch.load(cfg.output_dir / "final_model.pt")


def test_kappa_one_equals_plain_dp_fedavg_bit_exactly(small_config, tmp_path):
    base = small_config("rounds=3", f"output_dir={tmp_path / 'base'}")
    disk = small_config("rounds=3", "server.disk={kappa: 1.0, gamma: 0.5}", f"output_dir={tmp_path / 'disk'}")
    run(base)
    run(disk)
    a, b = _final(base), _final(disk)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_first_round_equals_the_base_and_later_rounds_differ(small_config, tmp_path):
    runs = {}
    for name, extra in (("base", ()), ("disk", ("server.disk={kappa: 0.7, gamma: 0.5}",))):
        for rounds in (1, 3):
            cfg = small_config(f"rounds={rounds}", *extra, f"output_dir={tmp_path / f'{name}{rounds}'}")
            run(cfg)
            runs[name, rounds] = _final(cfg)
    assert all(torch.equal(runs["base", 1][k], runs["disk", 1][k]) for k in runs["base", 1])
    assert not torch.equal(runs["base", 3]["embedding.weight"], runs["disk", 3]["embedding.weight"])
    # the filter and displacement are checkpointed for an exact resume
    state = torch.load(tmp_path / "disk3" / "checkpoint.pt", weights_only=False)["disk"]
    assert state["filtered"] is not None and state["displacement"] is not None


def test_client_sends_one_combined_two_point_update_with_common_randomness(small_config):
    cfg = small_config("server.disk={kappa: 0.7, gamma: 0.5}")
    task = load_task(cfg.data)
    model = task.new_model()
    torch.nn.init.normal_(model.embedding.weight, std=0.01)
    x = parameters_to_vector(model.parameters()).detach().clone()
    lookahead = x + 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0)) * 0.01
    ahead_model = task.new_model()
    torch.nn.utils.vector_to_parameters(lookahead, ahead_model.parameters())
    c = disk_coefficient(0.7, 0.5)
    content = RecordDict({"arrays": model_to_record(model), "lookahead": model_to_record(ahead_model),
                          "config": ConfigRecord({"server-round": 2, "disk-c": c})})
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    msg = Message(content, dst_node_id=5, message_type="train")
    partition = 3
    reply = build_client_app(cfg)(msg, Context(run_id=1, node_id=5, node_config={"partition-id": partition},
                                               state=RecordDict(), run_config={}))
    update = record_to_update(reply.content["arrays"], x.numel())
    X, y = task.client_data(partition)
    fresh = task.new_model()
    torch.nn.utils.vector_to_parameters(x, fresh.parameters())
    kw = dict(epochs=1, batch_size=10, lr=5.0)
    d_ahead = local_sgd(fresh, X, y, rng=client_generator(cfg.seed, 2, partition), start_from=lookahead, **kw).update
    d_now = local_sgd(fresh, X, y, rng=client_generator(cfg.seed, 2, partition), **kw).update
    expected = c * d_ahead.to_dense() + (1 - c) * d_now.to_dense()
    assert isinstance(reply.content["arrays"], ArrayRecord) and set(reply.content["arrays"].keys()) == {"indices", "values"}
    assert torch.allclose(update.to_dense(), expected, atol=1e-6)
    assert expected.abs().max() > 0
