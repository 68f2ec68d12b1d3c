"""digit_writers: the ClientApp. A stock Flower client whose data comes from Flower Datasets through
``load_data(partition_id, num_partitions)``; fedprivacy's client mod clips and noises on the device when the
noise placement is not central."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digit_writers.task import load_task, run_config, train
from fedprivacy import client_noise_mod


def noise_on_device(msg: Message, context: Context, call_next):
    """With ``noise-placement = "distributed"`` or ``"local"``, clip and noise on the device
    (:func:`fedprivacy.client_noise_mod`); with ``"central"`` the server does both. This demo reads the settings
    from the run config the server launches; devices that do not trust the server pass their own values."""
    cfg = run_config(context)
    if cfg["noise-placement"] == "central":
        return call_next(msg, context)
    mod = client_noise_mod(placement=cfg["noise-placement"], noise_multiplier=cfg["noise-multiplier"],
                           clip_norm=cfg["clip-norm"], expected_cohort=cfg["expected-cohort"])
    return mod(msg, context, call_next)


app = ClientApp(mods=[noise_on_device])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    task = load_task(cfg["data-dir"], cfg["seed"])
    model = task.new_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    writer = int(context.node_config["partition-id"])
    x, y = task.load_data(writer, int(context.node_config["num-partitions"]))
    train(model, x, y, task.loss, cfg["local-epochs"], cfg["local-lr"], cfg["batch-size"],
          seed=(cfg["seed"], writer, msg.content["config"]["server-round"]))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)
