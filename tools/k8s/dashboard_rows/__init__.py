"""The dashboard's rows, one module each: a TITLE and its PANELS, in dashboard order in
dashboard_panels.py."""
