"""The ASGI scope key that marks a request the batch runner made (batch/runner.py): such a
request is priced at the batch factor (api/job_start.py). Only code in this process can put
it in a scope; nothing from the network can."""

BATCH_SCOPE_KEY = "kvflow.batch_line"
