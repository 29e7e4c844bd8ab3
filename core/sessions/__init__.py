"""Every run recorded, replayed and exported.

Public: ``store`` (SessionStore, one SQLite file per workspace), ``schema`` (the file's
tables and migrations), ``recording`` (a run into the store), ``replay`` (a recorded run at
any speed), ``export`` (Chrome trace, CSV).
"""
