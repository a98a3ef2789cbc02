"""Small task-pack data shared by the lens tests (a module with a unique name, not conftest)."""
from __future__ import annotations

from types import SimpleNamespace

SALES_CSV = (
    "region,units,price,margin\n"
    "North,120,3.50,22%\n"
    "South,85,4.25,18%\n"
    "East,240,2.75,31%\n"
)
PLAN_JSON = '{"pilot": {"sites": 4, "budget": 15000}, "team": {"engineers": 3}}'
NOTES_TXT = "Pilot notes\n- Dock doors: 24\n- Trucks per day: 60\nThe yard is busy in the morning.\n"
FEEDBACK_CSV = "customer,score,tickets\nAcme,7,12\nBolt,9,3\n"


def make_pack() -> SimpleNamespace:
    """A pack with the `lhd_train.bench.taskpack.TaskPack` shape: `.name`,
    `.tasks[i].index/.title/.files[j].name/.type/.content`."""
    def f(name, type_, content):
        return SimpleNamespace(name=name, type=type_, content=content)

    return SimpleNamespace(name="mini", tasks=[
        SimpleNamespace(index=1, title="Sales review",
                        files=[f("sales.csv", "csv", SALES_CSV), f("notes.txt", "text", NOTES_TXT)]),
        SimpleNamespace(index=2, title="Pilot plan", files=[f("plan.json", "json", PLAN_JSON)]),
        SimpleNamespace(index=3, title="Customer feedback", files=[f("feedback.csv", "csv", FEEDBACK_CSV)]),
    ])
