"""The rq jobs: diff and compaction. Each decodes its arguments, calls pipeline/ and
publishes the result.
"""
