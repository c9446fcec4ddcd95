"""The bus between stateless gateway replicas and the schedulers.

    base.py        the Bus interface (gateway side and worker side) and its delivery contract
    messages.py    BusRequest and OutputEvent, with their JSON wire form
    memory_bus.py  in-process implementation (embedded mode, `dspark serve`)
    redis_bus.py   Redis Streams implementation (distributed mode, `dspark gateway --redis URL`)
    worker.py      the scheduler-side loop: bus requests in, AsyncEngine, output events out
    round_relay.py the engine's round events onto the bus while a gateway's round view watches

Exactly-once output per request rests on epoch fencing and offsets (see base.py) and on the
worker continuing a re-claimed request from the tokens already published (see worker.py).
"""

from dspark.bus.base import Bus, BusFull, Delivery, DuplicateRequest, LostOwnership, Published, UnknownRequest
from dspark.bus.memory_bus import MemoryBus
from dspark.bus.messages import BusRequest, EventError, OutputEvent, OutputStats

__all__ = [
    "Bus",
    "BusFull",
    "BusRequest",
    "Delivery",
    "DuplicateRequest",
    "EventError",
    "LostOwnership",
    "MemoryBus",
    "OutputEvent",
    "OutputStats",
    "Published",
    "UnknownRequest",
]
