"""digits: the ClientApp. A stock Flower client (local SGD, replies its full weights); the only
fedprivacy piece is the optional client mod that clips and noises the update on the device (and, with
``secure-aggregation``, masks it for SecAgg+)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digits.task import load_user, make_model, run_config, train
from fedprivacy import client_noise_mod, secure_aggregation_mod


def noise_on_device(msg: Message, context: Context, call_next):
    """With ``noise-placement = "distributed"`` or ``"local"``, clip and noise on the device
    (:func:`fedprivacy.fl.mods.client_noise_mod`), or with ``secure-aggregation = true`` add a Skellam share and
    answer SecAgg+ (:func:`fedprivacy.secure_aggregation_mod`); with ``"central"`` the server does both.

    This demo reads the noise and SecAgg+ settings from the run config, which the SERVER launches: fine for a
    simulation, but on real devices that do not trust the server pass the mods the device's own values (its code
    or ``context.node_config``), as fedprivacy's own ClientApp does (docs/DEPLOYMENT.md, "the noise floor")."""
    cfg = run_config(context)
    if cfg["noise-placement"] == "central":
        return call_next(msg, context)
    if cfg["secure-aggregation"]:
        mod = secure_aggregation_mod(noise_multiplier=cfg["noise-multiplier"], clip_norm=cfg["clip-norm"],
                                     expected_cohort=cfg["expected-cohort"], bits=cfg["secagg-bits"],
                                     threshold=cfg["secagg-threshold"], neighbours=cfg["secagg-neighbours"])
    else:
        mod = client_noise_mod(placement=cfg["noise-placement"], noise_multiplier=cfg["noise-multiplier"],
                               clip_norm=cfg["clip-norm"], expected_cohort=cfg["expected-cohort"])
    return mod(msg, context, call_next)


app = ClientApp(mods=[noise_on_device])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    model = make_model(cfg["hidden"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    user, users = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = load_user(user, users, cfg["seed"])
    train(model, x, y, cfg["local-epochs"], cfg["local-lr"], cfg["batch-size"],
          seed=(cfg["seed"], user, msg.content["config"]["server-round"]))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)
