"""Remote media for the OpenAI-compatible front, fetched without SSRF.

Off unless the operator names the hosts (``--allowed-media-domains``); the front then refuses
every http(s) URL. With hosts named, a URL is fetched only if all of these hold, for the URL
and for every redirect (redirects are followed here, one hop at a time, never by httpx):

- the scheme is http or https, and the URL carries no user info;
- the host is exactly one of the allowed hosts: ``a.com`` does not admit ``cdn.a.com`` (the
  rule of vLLM's flag of the same name; list every host);
- every address the host resolves to is globally routable: not unspecified, loopback,
  link-local, multicast, reserved or private, IPv4 or IPv6, also when an IPv4 address hides in
  an IPv6 one (IPv4-mapped, 6to4; NAT64 is reserved);
- the request goes to the address that was checked: the URL's host becomes that IP, while the
  Host header and TLS (SNI and the certificate check) keep the name. A second DNS answer
  cannot send it elsewhere (DNS rebinding).

No proxy from the environment is used, and no connection is kept alive (a pooled connection
opened for one name must not carry a request for another name on the same IP). A request's URLs
are fetched one at a time, all within one timeout and the gateway's byte limits (per item and
per request), so a request naming many URLs holds one connection and bounded memory.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

import httpx

from epd.domain import MediaFile

Resolver = Callable[[str, int], Awaitable[list[str]]]

# Python releases before 3.11.10 and 3.12.4 call these IPv4 ranges global.
_NOT_GLOBAL = (ipaddress.ip_network("192.0.0.0/24"),)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class MediaFetchError(Exception):
    """A URL refused or not fetched; the message says why and is shown to the client."""


def address_problem(address: str) -> str | None:
    """Why an address must not be dialled ("loopback", "private", ...), or None when it is
    globally routable."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # without an IPv6 scope id
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            problem = address_problem(str(embedded))
            return f"{problem} (in {ip})" if problem else None
    for kind in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if not ip.is_global or any(ip in network for network in _NOT_GLOBAL):
        return "not globally routable"
    return None


def normal_host(url: httpx.URL) -> str:
    """The host as compared with the allow list: IDNA-encoded, lower case, no trailing dot."""
    return url.raw_host.decode("ascii").lower().rstrip(".")


def check_url(url: str, allowed_hosts: frozenset[str]) -> httpx.URL:
    """The parsed URL if its scheme, form and host may be fetched; raises MediaFetchError."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise MediaFetchError(f"is not a valid URL ({exc})") from exc
    if parsed.scheme not in _DEFAULT_PORTS:
        raise MediaFetchError(f"has scheme {parsed.scheme!r}: only http and https are fetched")
    if parsed.userinfo:
        raise MediaFetchError("carries credentials (user info), which are never sent")
    host = normal_host(parsed)
    if host not in allowed_hosts:
        raise MediaFetchError(f"names host {host!r}, which is not in the gateway's --allowed-media-domains")
    return parsed


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class MediaFetcher:
    """Fetches media URLs under the rules above. ``resolve`` and ``transport`` are replaced by
    tests, which must not touch the network."""

    def __init__(
        self,
        allowed_hosts: Iterable[str],
        *,
        max_item_bytes: int,
        max_request_bytes: int,
        timeout_s: float,
        max_redirects: int = 5,
        resolve: Resolver = system_resolve,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.allowed_hosts = frozenset(normal_host(httpx.URL(f"http://{host.strip()}/")) for host in allowed_hosts if host.strip())
        self.max_item_bytes = max_item_bytes
        self.max_request_bytes = max_request_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self._resolve = resolve
        self._client = httpx.AsyncClient(
            transport=transport,
            trust_env=False,
            follow_redirects=False,
            timeout=timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def fetch_all(self, urls: list[str]) -> list[MediaFile | MediaFetchError]:
        """Each URL's media (with the MIME type its server declares), or why it was not taken."""
        results: list[MediaFile | MediaFetchError] = []
        left = self.max_request_bytes
        try:
            async with asyncio.timeout(self.timeout_s):
                for url in urls:
                    try:
                        media = await self._follow(url, min(self.max_item_bytes, left))
                    except MediaFetchError as exc:
                        results.append(exc)
                    except httpx.HTTPError as exc:
                        results.append(MediaFetchError(f"could not be fetched ({type(exc).__name__}: {exc})"))
                    else:
                        left -= len(media.data)
                        results.append(media)
        except TimeoutError:
            late = MediaFetchError(f"was not fetched within {self.timeout_s:g} s (the time for all of a request's remote media)")
            results += [late] * (len(urls) - len(results))
        return results

    async def _public_address(self, host: str, port: int) -> str:
        """The address to dial for ``host``: its first, once every address it resolves to is
        globally routable."""
        try:
            addresses = await self._resolve(host, port)
        except OSError as exc:
            raise MediaFetchError(f"names host {host!r}, which does not resolve ({exc})") from exc
        if not addresses:
            raise MediaFetchError(f"names host {host!r}, which does not resolve")
        for address in addresses:
            if problem := address_problem(address):
                raise MediaFetchError(f"names host {host!r}, which resolves to a blocked address ({address}: {problem})")
        return addresses[0]

    async def _follow(self, url: str, max_bytes: int) -> MediaFile:
        for _ in range(self.max_redirects + 1):
            target = check_url(url, self.allowed_hosts)
            host = normal_host(target)
            address = await self._public_address(host, target.port or _DEFAULT_PORTS[target.scheme])
            request = self._client.build_request(
                "GET",
                target.copy_with(host=address),
                headers={"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"},
                extensions={"sni_hostname": host} if target.scheme == "https" else {},
            )
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect:
                    try:
                        url = str(target.join(response.headers["location"]))
                    except httpx.InvalidURL as exc:
                        raise MediaFetchError(f"was redirected to an invalid URL ({exc})") from exc
                    continue
                if response.status_code != 200:
                    raise MediaFetchError(f"was answered with HTTP {response.status_code}")
                return MediaFile(await self._body(response, max_bytes), response.headers.get("content-type", "").partition(";")[0].strip().lower())
            finally:
                await response.aclose()
        raise MediaFetchError(f"redirected more than {self.max_redirects} times")

    async def _body(self, response: httpx.Response, max_bytes: int) -> bytes:
        # Uncompressed bodies only: a compressed one could expand past the limit before we count it.
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            raise MediaFetchError(f"came with Content-Encoding {response.headers['content-encoding']!r}; only identity is taken")
        limit = f"the {max_bytes} bytes left for it (--max-item-bytes {self.max_item_bytes}, --max-request-bytes {self.max_request_bytes})"
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise MediaFetchError(f"is {declared} bytes, over {limit}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise MediaFetchError(f"is over {limit}")
        return bytes(body)
