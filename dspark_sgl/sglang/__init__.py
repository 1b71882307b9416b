"""SGLang integration: the only subpackage that imports sglang.

`plugin.load` is the `sglang.srt.plugins` entry point: it hands `--speculative-algorithm DSPARK` to
`worker.DSparkWorker`. Importing this package itself does not import sglang.
"""
