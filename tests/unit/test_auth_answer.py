"""How an auth server's answer is read (security/authorizer.read_answer), over a stand-in
for Twisted's response and an in-memory transport: a body ended by the close of the
connection is whole when nothing declared its length, and cut short when something did;
the size limit holds while the body streams, and is applied to a declared length before
any byte is read; a timeout's cancel closes the connection."""

from __future__ import annotations

import pytest
from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss, _DataLoss
from twisted.web.iweb import UNKNOWN_LENGTH

from dmq_server.core.auth import AnswerError
from dmq_server.security.authorizer import read_answer

pytestmark = pytest.mark.unit


class Response:
    """What read_answer uses of Twisted's ``IResponse``: the declared length, and the body
    delivered to a protocol over a transport."""

    def __init__(self, length=UNKNOWN_LENGTH):
        self.length = length
        self.transport = StringTransport()
        self.body = None

    def deliverBody(self, protocol):  # noqa: N802
        self.body = protocol
        protocol.makeConnection(self.transport)


def outcome(d: defer.Deferred):
    got = []
    d.addBoth(got.append)
    assert got, "read_answer has not decided yet"
    return got[0]


def failed_with(d: defer.Deferred) -> str:
    result = outcome(d)
    assert isinstance(result, Failure) and result.check(AnswerError), result
    return str(result.value)


@pytest.mark.parametrize("length, end, whole", [
    (UNKNOWN_LENGTH, PotentialDataLoss(), True),  # HTTP/1.0 without a length: the close is the end
    (UNKNOWN_LENGTH, ResponseDone(), True),  # the last chunk
    (8, ResponseDone(), True),  # the Content-Length
    (12, PotentialDataLoss(), False),  # the close came before the declared length
    (12, ResponseFailed([Failure(ConnectionDone()), Failure(_DataLoss())]), False),
    (UNKNOWN_LENGTH, ResponseFailed([Failure(ConnectionDone()), Failure(_DataLoss("Chunked decoder"))]), False),
])
def test_a_body_is_whole_when_its_end_is_the_one_it_declared(length, end, whole):
    response = Response(length)
    d = read_answer(response, limit=100)
    response.body.dataReceived(b'{"ttl"')
    response.body.dataReceived(b": 1}")
    response.body.connectionLost(Failure(end))
    if whole:
        assert outcome(d) == b'{"ttl": 1}'
    elif length is UNKNOWN_LENGTH:
        assert failed_with(d).startswith("the answer ended after 10 bytes, short of its end: ConnectionDone")
    else:
        assert failed_with(d) == "the answer ended after 10 of the 12 bytes its Content-Length declared"
    assert not response.transport.disconnected


def test_a_body_over_the_limit_is_not_read_further():
    response = Response()
    d = read_answer(response, limit=10)
    response.body.dataReceived(b"x" * 6)
    assert not d.called
    response.body.dataReceived(b"x" * 6)
    assert failed_with(d) == "an answer over the limit of 10 bytes (not read further)"
    assert response.transport.disconnected  # aborted
    response.body.dataReceived(b"x" * 6)  # what was on its way is dropped
    response.body.connectionLost(Failure(PotentialDataLoss()))
    assert response.body.parts == []


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    response = Response(length=11)
    d = read_answer(response, limit=10)
    assert failed_with(d) == "an answer of 11 bytes (Content-Length), over the limit of 10"
    assert response.transport.disconnected  # aborted


def test_cancelling_closes_the_connection():
    response = Response()
    d = read_answer(response, limit=10)
    response.body.dataReceived(b"{")
    d.cancel()
    assert outcome(d).check(defer.CancelledError)
    assert response.transport.disconnected  # aborted
    response.body.connectionLost(Failure(ConnectionDone()))  # after the abort: nothing more happens


def test_the_authorizer_interface_is_a_typing_protocol_not_a_connection():
    """``Authorizer`` states what the sessions ask of an authorizer (``query``, ``reload``).
    A second ``Protocol`` import (Twisted's) once shadowed typing's, so it was a Twisted
    connection protocol that nothing could check an authorizer against."""
    from twisted.internet.protocol import Protocol as TwistedProtocol

    from dmq_server.security.authorizer import Authorizer, FileAuthorizer, HttpAuthorizer

    assert not issubclass(Authorizer, TwistedProtocol)
    assert getattr(Authorizer, "_is_protocol", False)
    assert {"query", "reload"} <= set(dir(FileAuthorizer)) & set(dir(HttpAuthorizer))
