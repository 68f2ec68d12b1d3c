"""A federated data set of your own in TFDS's format (needs tensorflow-datasets only, no TensorFlow)."""
import numpy as np
import tensorflow_datasets as tfds


class UserPoints(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "x": tfds.features.Tensor(shape=(2,), dtype=np.float32),
            "label": tfds.features.ClassLabel(num_classes=2),
            "user": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(4000, 0), "test": self._generate_examples(1000, 1),
                "validation": self._generate_examples(500, 2)}

    def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):
            x = rng.normal(size=2).astype(np.float32)
            yield i, {"x": x, "label": int(x[0] + 0.3 * x[1] > 0), "user": f"user-{rng.integers(200)}"}


if __name__ == "__main__":
    UserPoints(data_dir="tfds_data", file_format="array_record").download_and_prepare()
