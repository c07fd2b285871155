"""multipart/form-data, as `POST /v1/files` receives it (file + purpose). Pure; the body was
read under its size limit before it gets here."""

from __future__ import annotations

from dataclasses import dataclass


class MultipartError(ValueError):
    pass


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    content: bytes


def boundary_of(content_type: str) -> bytes:
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise MultipartError("The upload must be multipart/form-data (fields file and purpose).")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip('"').encode("latin-1")
    raise MultipartError("The multipart/form-data content type has no boundary.")


def _disposition(headers: bytes) -> tuple[str, str | None]:
    for header in headers.split(b"\r\n"):
        key, _, value = header.decode("utf-8", "replace").partition(":")
        if key.strip().lower() != "content-disposition":
            continue
        fields: dict[str, str] = {}
        for item in value.split(";")[1:]:
            k, _, v = item.strip().partition("=")
            fields[k.lower()] = v.strip().strip('"')
        if "name" in fields:
            return fields["name"], fields.get("filename")
    raise MultipartError("A multipart part has no Content-Disposition name.")


def parse_multipart(body: bytes, boundary: bytes) -> dict[str, Part]:
    """The parts by field name (the first of a repeated name)."""
    delimiter = b"--" + boundary
    pieces = body.split(delimiter)
    if len(pieces) < 3:
        raise MultipartError("The multipart body has no parts.")
    parts: dict[str, Part] = {}
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            break  # the closing delimiter
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise MultipartError("A multipart part has no header/body separator.")
        name, filename = _disposition(head.strip(b"\r\n"))
        if content.endswith(b"\r\n"):
            content = content[:-2]
        parts.setdefault(name, Part(name, filename, content))
    return parts
