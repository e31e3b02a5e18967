"""docs/screenshots.py's walk-through with the Jobs dock open from the first step (issue 49), as a new user who
follows the tutorial with the Jobs dock open sees it: the job docks join it as tabs of the plugin's panel (each job
dock closed before the next, as the script does). The same arguments as docs/screenshots.py:

    xvfb-run -a -s "-screen 0 1366x768x24" .venv/bin/python docs/screenshots_with_jobs_dock.py [--out docs/images]
        [--work DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import screenshots  # noqa: E402

_walkthrough_init = screenshots.Walkthrough.__init__


def _with_jobs_dock(self, out, work) -> None:
    _walkthrough_init(self, out, work)
    self.viewer.window.add_plugin_dock_widget(screenshots.PLUGIN, "Jobs")  # Plugins > GPU RELION > Jobs
    screenshots._pump(0.5)


screenshots.Walkthrough.__init__ = _with_jobs_dock

if __name__ == "__main__":
    screenshots.main()
