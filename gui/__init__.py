"""PySide6 + pyqtgraph views over core/. Holds no domain logic."""
