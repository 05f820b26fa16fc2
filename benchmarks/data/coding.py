"""A coding-assistant session: a long system prompt, a small project's files, and questions.

Every request sends the system prompt, then the project files (one part each, in the order an
editor lists its open files), then the question. Two events change the context on the way, as
in a real session: a file is edited (its text changes from then on), and later the files are
reordered (the edited file moves to the front, most recently used first).
"""
from __future__ import annotations

SYSTEM = " ".join([
    "You are Forge, a coding assistant for the inventory service of a small hardware store.",
    "You answer questions about the project files you are given. Be brief: one or two sentences, or a short",
    "code snippet when the user asks for code. Never invent functions that are not in the files.",
    "Conventions of this project: Python 3.11, type hints everywhere, dataclasses for records,",
    "no global mutable state, errors raised as InventoryError with a clear message, quantities are",
    "integers and prices are integers in cents. Tests use pytest and live next to the code they test.",
    "Functions stay short (under fifty lines); modules under three hundred lines. Names say what a thing",
    "is. Public functions have docstrings; comments explain why, not what. Database access goes through",
    "the repository module only; the service module holds the business rules; the api module only",
    "translates requests and responses. When you suggest a change, keep the existing style and mention",
    "which file it belongs in. When a question cannot be answered from the files, say so.",
    "Review checklist: input validated at the boundary, no silent fallbacks, every branch tested,",
    "no quadratic loops over the whole inventory, log lines carry the SKU, money never uses floats.",
]) * 2

FILES = {
    "inventory/models.py": '''from dataclasses import dataclass


class InventoryError(Exception):
    """A request the inventory cannot satisfy."""


@dataclass(slots=True)
class Item:
    sku: str
    name: str
    quantity: int
    price_cents: int

    def total_value(self) -> int:
        return self.quantity * self.price_cents


@dataclass(slots=True)
class Reservation:
    sku: str
    quantity: int
    customer: str
''',
    "inventory/repository.py": '''from .models import InventoryError, Item


class Repository:
    """Items by SKU, kept in memory (a database in production)."""

    def __init__(self):
        self._items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.sku in self._items:
            raise InventoryError(f"duplicate SKU {item.sku}")
        self._items[item.sku] = item

    def get(self, sku: str) -> Item:
        try:
            return self._items[sku]
        except KeyError:
            raise InventoryError(f"unknown SKU {sku}") from None

    def all(self) -> list[Item]:
        return list(self._items.values())
''',
    "inventory/service.py": '''from .models import InventoryError, Reservation
from .repository import Repository

LOW_STOCK = 5


def reserve(repo: Repository, sku: str, quantity: int, customer: str) -> Reservation:
    """Take `quantity` units of `sku` out of stock for `customer`."""
    if quantity <= 0:
        raise InventoryError("quantity must be positive")
    item = repo.get(sku)
    if item.quantity < quantity:
        raise InventoryError(f"only {item.quantity} of {sku} left")
    item.quantity -= quantity
    return Reservation(sku, quantity, customer)


def low_stock(repo: Repository) -> list[str]:
    """SKUs with fewer than LOW_STOCK units."""
    return [item.sku for item in repo.all() if item.quantity < LOW_STOCK]


def stock_value(repo: Repository) -> int:
    return sum(item.total_value() for item in repo.all())
''',
    "inventory/api.py": '''from .models import InventoryError
from .repository import Repository
from .service import low_stock, reserve


def handle_reserve(repo: Repository, body: dict) -> tuple[int, dict]:
    try:
        reservation = reserve(repo, body["sku"], int(body["quantity"]), body["customer"])
    except (KeyError, ValueError):
        return 400, {"error": "sku, quantity and customer are required"}
    except InventoryError as err:
        return 409, {"error": str(err)}
    return 200, {"sku": reservation.sku, "quantity": reservation.quantity}


def handle_low_stock(repo: Repository) -> tuple[int, dict]:
    return 200, {"skus": low_stock(repo)}
''',
    "tests/test_service.py": '''import pytest

from inventory.models import InventoryError, Item
from inventory.repository import Repository
from inventory.service import low_stock, reserve


def make_repo() -> Repository:
    repo = Repository()
    repo.add(Item("HAM-1", "Claw hammer", 12, 1599))
    repo.add(Item("SCR-8", "Wood screws, box of 100", 3, 499))
    return repo


def test_reserve_takes_stock():
    repo = make_repo()
    reserve(repo, "HAM-1", 2, "ana")
    assert repo.get("HAM-1").quantity == 10


def test_reserve_too_many():
    with pytest.raises(InventoryError):
        reserve(make_repo(), "SCR-8", 4, "ben")


def test_low_stock():
    assert low_stock(make_repo()) == ["SCR-8"]
''',
}

# The edit made at EDIT_STEP: reservations now record a price snapshot.
EDITED_FILE = "inventory/service.py"
EDIT = ("    item.quantity -= quantity\n    return Reservation(sku, quantity, customer)\n",
        "    item.quantity -= quantity\n    log.info(\"reserved %s x%d for %s\", sku, quantity, customer)\n"
        "    return Reservation(sku, quantity, customer)\n")

QUESTIONS = [
    "Which function reserves stock, and in which file is it?",
    "What happens when a customer asks for more units than are in stock?",
    "Which HTTP status does the API return for an unknown SKU?",
    "What does the service log when a reservation succeeds?",
    "How is the low-stock threshold defined?",
    "Write a test for reserving a quantity of zero.",
    "How is the total value of the stock computed?",
    "Which module may access the database?",
    "What does handle_low_stock return?",
    "Which fields does a Reservation have?",
]
EDIT_STEP = 3          # 0-based: requests from this one on see the edited file
REORDER_STEP = 5       # from this one on, the edited file is listed first


def project_files(step: int) -> list[tuple[str, str]]:
    """(path, text) of every file as the editor sends them at request `step`."""
    files = dict(FILES)
    if step >= EDIT_STEP:
        before, after = EDIT
        files[EDITED_FILE] = files[EDITED_FILE].replace(before, after).replace(
            "from .repository import Repository\n", "from .repository import Repository\n\nlog = logging.getLogger(__name__)\n"
        ).replace("from .models", "import logging\n\nfrom .models", 1)
    order = list(files)
    if step >= REORDER_STEP:
        order.remove(EDITED_FILE)
        order.insert(0, EDITED_FILE)
    return [(path, files[path]) for path in order]


def file_part(path: str, text: str) -> str:
    return f"File {path}:\n```python\n{text}```"


def event_at(step: int) -> str:
    return {EDIT_STEP: f"edit {EDITED_FILE}", REORDER_STEP: "reorder files"}.get(step, "")
