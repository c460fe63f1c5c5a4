"""The pipeline's errors. Each carries the exit status ``dmq-pipeline`` returns for it."""

from __future__ import annotations

__all__ = ["PipelineError", "UsageError", "DatabaseUnreachable", "JobFailed"]


class PipelineError(Exception):
    """A pipeline job could not run or did not finish; the message says what to do."""

    code = 1


class UsageError(PipelineError):
    """Bad arguments or a missing prerequisite (JDBC jar, Java, schema); nothing was changed."""

    code = 2


class DatabaseUnreachable(PipelineError):
    """PostgreSQL could not be reached; nothing was changed."""

    code = 3


class JobFailed(PipelineError):
    """The job started but could not finish; what was done is recorded and a re-run resumes."""

    code = 1
