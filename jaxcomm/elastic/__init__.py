"""Elastic restarts: a run's state moved onto another number of devices, on the host.

``resize`` (error feedback: ``resize_state``, its pending sum kept), ``reshard`` (a whole
``TrainState``: ``reshard_train_state``, ``train_state_template``), ``diloco``
(``resize_diloco_state``). Public names are exported from :mod:`jaxcomm`.
"""

from jaxcomm.elastic.diloco import resize_diloco_state as resize_diloco_state
from jaxcomm.elastic.reshard import reshard_train_state as reshard_train_state
from jaxcomm.elastic.reshard import train_state_template as train_state_template
from jaxcomm.elastic.resize import resize_state as resize_state

__all__ = ["reshard_train_state", "resize_diloco_state", "resize_state", "train_state_template"]
